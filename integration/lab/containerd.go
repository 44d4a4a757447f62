package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/template"
	"time"

	"github.com/imagefleet/imagefleet/services/cri"
)

// Options configures a private containerd.
type Options struct {
	// SandboxImage is the pod sandbox (pause) image, a reference into a loopback registry, for example
	// reg.Ref("lab/pause:1") after PushBusybox. No public registry is reachable here, so without it
	// RunPodSandbox fails; tests that only pull and remove images may leave it empty.
	SandboxImage string
	// TmpfsSize is the size of the tmpfs that holds containerd's root, and so the image filesystem, in
	// mount(8)'s size= syntax. Default "64m".
	TmpfsSize string
	// Snapshotter is "overlayfs" or "native". Default: overlayfs when an overlay mount works on the tmpfs
	// (it does on this project's machines), native otherwise.
	Snapshotter string
	// StatsCollectPeriod is how often containerd refreshes the used bytes that ImageFsInfo reports, in whole
	// seconds. Default 1s: containerd's own default (10s) would make every usage assertion wait.
	StatsCollectPeriod time.Duration
	// MaxConcurrentDownloads bounds the layers one pull downloads at once. Default 3 (containerd's).
	MaxConcurrentDownloads int
	// StartTimeout bounds each start until CRI answers Version. Default 30s.
	StartTimeout time.Duration
}

func (o *Options) defaults() {
	if o.TmpfsSize == "" {
		o.TmpfsSize = "64m"
	}
	if o.StatsCollectPeriod <= 0 {
		o.StatsCollectPeriod = time.Second
	}
	if o.MaxConcurrentDownloads <= 0 {
		o.MaxConcurrentDownloads = 3
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 30 * time.Second
	}
}

// TestDirPrefix starts the name of every directory StartContainerd creates under /tmp. .ci/run removes
// leftovers with this prefix (from a test binary that was killed before its cleanup ran).
const TestDirPrefix = "ifl-t-"

// installHint is the end of every "missing part" failure.
const installHint = "install it as .ci/run does: apt-get install -y containerd runc busybox-static docker-registry"

// Containerd is a private containerd with its own root (a tmpfs), state, sockets and runc state. It is
// stopped and its traces removed (pods, shims, mounts, directories) when the test ends.
type Containerd struct {
	t    testing.TB
	opts Options

	dir        string // everything lives under dir: /tmp/ifl-t-XXXX
	root       string // the tmpfs: containerd's root and the image filesystem
	configPath string
	logPath    string
	grpcSock   string
	runcRoot   string
	snap       string
	client     *cri.Client

	// mu guards the process fields; Start, Stop and Kill run on the test goroutine, the waiter on its own.
	mu     sync.Mutex
	proc   *os.Process
	exited chan struct{} // closed when the current process has exited
}

// StartContainerd starts a private containerd and waits until its CRI service answers. It fails the test
// when not run as root or when containerd, runc or the runc shim are not installed.
func StartContainerd(t testing.TB, opts Options) *Containerd {
	t.Helper()
	opts.defaults()
	requireRoot(t)
	for _, bin := range []string{"containerd", "containerd-shim-runc-v2", "runc"} {
		requireBinary(t, bin)
	}
	// Unix socket paths must stay under 108 bytes, so the directory is short and under /tmp, not
	// t.TempDir() (whose name carries the test's name).
	dir, err := os.MkdirTemp("/tmp", TestDirPrefix)
	if err != nil {
		t.Fatalf("lab: create containerd dir: %v", err)
	}
	c := &Containerd{
		t:          t,
		opts:       opts,
		dir:        dir,
		root:       filepath.Join(dir, "root"),
		configPath: filepath.Join(dir, "config.toml"),
		logPath:    filepath.Join(dir, "containerd.log"),
		grpcSock:   filepath.Join(dir, "containerd.sock"),
		runcRoot:   filepath.Join(dir, "runc"),
	}
	// Registered before anything can fail, so a half-built lab is torn down too.
	t.Cleanup(c.cleanup)

	for _, d := range []string{c.root, filepath.Join(dir, "state"), c.runcRoot, filepath.Join(dir, "cni"), filepath.Join(dir, "opt")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatalf("lab: create %s: %v", d, err)
		}
	}
	if err := syscall.Mount("ifl-tmpfs", c.root, "tmpfs", 0, "size="+opts.TmpfsSize); err != nil {
		t.Fatalf("lab: mount tmpfs of size %s on %s: %v", opts.TmpfsSize, c.root, err)
	}
	c.snap = opts.Snapshotter
	if c.snap == "" {
		c.snap = "native"
		if err := probeOverlay(c.root); err == nil {
			c.snap = "overlayfs"
		} else {
			t.Logf("lab: overlayfs does not work on tmpfs here, using the native snapshotter: %v", err)
		}
	}
	if err := c.writeConfig(); err != nil {
		t.Fatalf("lab: %v", err)
	}
	c.client, err = cri.Dial(cri.Config{Endpoint: c.Endpoint(), Timeout: time.Minute})
	if err != nil {
		t.Fatalf("lab: %v", err)
	}
	c.Start()
	return c
}

// Endpoint is the CRI endpoint: unix:///tmp/ifl-t-XXXX/containerd.sock.
func (c *Containerd) Endpoint() string { return "unix://" + c.grpcSock }

// Client is a CRI client of this containerd. It is the same client across Stop and Start, as an agent's
// would be across a runtime restart.
func (c *Containerd) Client() *cri.Client { return c.client }

// Root is the tmpfs mountpoint that holds containerd's root: the image filesystem that statfs measures.
func (c *Containerd) Root() string { return c.root }

// Dir is the directory that holds everything of this containerd (config, log, sockets, state).
func (c *Containerd) Dir() string { return c.dir }

// Snapshotter is the snapshotter in use: overlayfs or native.
func (c *Containerd) Snapshotter() string { return c.snap }

// LogPath is containerd's log file (appended to across restarts).
func (c *Containerd) LogPath() string { return c.logPath }

// LogTail returns the last n lines of containerd's log.
func (c *Containerd) LogTail(n int) string {
	b, err := os.ReadFile(c.logPath)
	if err != nil {
		return fmt.Sprintf("(no containerd log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Start starts containerd (again, in place, after Stop or Kill) and waits until CRI answers Version. Images,
// containers and sandboxes persist across a restart, as on a node.
func (c *Containerd) Start() {
	c.t.Helper()
	if c.Running() {
		c.t.Fatalf("lab: start containerd: already running")
	}
	log, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		c.t.Fatalf("lab: open containerd log: %v", err)
	}
	fmt.Fprintf(log, "---- lab: starting containerd at %s\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command("containerd", "--config", c.configPath)
	cmd.Stdout, cmd.Stderr = log, log
	// Pdeathsig kills containerd if the test binary dies before its cleanup runs (a test timeout, a
	// SIGKILL). It fires when the forking thread exits, so the thread is locked below for containerd's
	// lifetime. Setpgid keeps a terminal's Ctrl-C from reaching containerd before cleanup stops it in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	started := make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(exited)
		defer log.Close()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait() // the exit status says nothing the log does not
	}()
	if err := <-started; err != nil {
		c.t.Fatalf("lab: start containerd: %v", err)
	}
	c.mu.Lock()
	c.proc, c.exited = cmd.Process, exited
	c.mu.Unlock()

	if err := c.waitReady(exited); err != nil {
		c.t.Fatalf("lab: start containerd: %v\ncontainerd log (%s), last lines:\n%s", err, c.logPath, c.LogTail(40))
	}
}

// waitReady polls until the CRI service answers Version, containerd exits, or StartTimeout passes.
func (c *Containerd) waitReady(exited <-chan struct{}) error {
	deadline := time.Now().Add(c.opts.StartTimeout)
	var last error
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return errors.New("containerd exited during start")
		default:
		}
		// Dial the socket itself first: a CRI call before the socket exists would put the shared client's
		// connection into gRPC's reconnect backoff, and the next test call would fail fast.
		if conn, err := net.Dial("unix", c.grpcSock); err != nil {
			last = err
		} else {
			conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, _, err := c.client.Version(ctx)
			cancel()
			if err == nil {
				return nil
			}
			last = err
		}
		time.Sleep(50 * time.Millisecond) // polling interval, not an assertion
	}
	return fmt.Errorf("CRI did not answer within %s: %w", c.opts.StartTimeout, last)
}

// Running reports whether containerd's process is alive.
func (c *Containerd) Running() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.exited == nil {
		return false
	}
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}

// Stop stops containerd gracefully (SIGTERM, then SIGKILL after 15s). Running containers keep running under
// their shims, as on a node whose runtime restarts.
func (c *Containerd) Stop() {
	c.t.Helper()
	if err := c.stop(15 * time.Second); err != nil {
		c.t.Fatalf("lab: stop containerd: %v", err)
	}
}

// Kill kills containerd with SIGKILL, as a crash would.
func (c *Containerd) Kill() {
	c.t.Helper()
	if err := c.stop(0); err != nil {
		c.t.Fatalf("lab: kill containerd: %v", err)
	}
}

// Restart is Stop then Start.
func (c *Containerd) Restart() {
	c.t.Helper()
	c.Stop()
	c.Start()
}

// stop sends SIGTERM (or SIGKILL when grace is 0), waits grace, then kills.
func (c *Containerd) stop(grace time.Duration) error {
	c.mu.Lock()
	proc, exited := c.proc, c.exited
	c.mu.Unlock()
	if proc == nil {
		return nil
	}
	select {
	case <-exited:
		return nil
	default:
	}
	if grace > 0 {
		_ = proc.Signal(syscall.SIGTERM)
		select {
		case <-exited:
			return nil
		case <-time.After(grace):
		}
	}
	_ = proc.Kill()
	select {
	case <-exited:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("containerd (pid %d) did not exit after SIGKILL", proc.Pid)
	}
}

// cleanup removes every trace: pods (through CRI while containerd runs, so their shims exit), containerd,
// leftover containers and shims (after a Kill), mounts, directories.
func (c *Containerd) cleanup() {
	if c.Running() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if err := RemovePods(ctx, c.Endpoint()); err != nil {
			c.t.Errorf("lab: cleanup: %v", err)
		}
		cancel()
	}
	if err := c.stop(10 * time.Second); err != nil {
		c.t.Errorf("lab: cleanup: %v", err)
	}
	if c.client != nil {
		_ = c.client.Close()
	}
	if err := killLeftovers(c.runcRoot, c.grpcSock); err != nil {
		c.t.Errorf("lab: cleanup: %v", err)
	}
	if c.t.Failed() {
		c.t.Logf("lab: containerd log (%s), last lines:\n%s", c.logPath, c.LogTail(40))
	}
	if err := UnmountUnder(c.dir); err != nil {
		c.t.Errorf("lab: cleanup: %v", err)
		return // never RemoveAll through a mount that is still there
	}
	if err := os.RemoveAll(c.dir); err != nil {
		c.t.Errorf("lab: cleanup: remove %s: %v", c.dir, err)
	}
}

// configTemplate holds the settings a private containerd needs on these machines (deploy/lab/README.md, "Why
// the containerd settings"); deploy/lab/containerd.toml.tmpl is the operator's copy of it.
var configTemplate = template.Must(template.New("config").Parse(`version = 2
root = "{{.Dir}}/root"
state = "{{.Dir}}/state"

[grpc]
  address = "{{.Dir}}/containerd.sock"

[ttrpc]
  address = "{{.Dir}}/containerd.sock.ttrpc"

# Without this every containerd on the machine shares /run/containerd/debug.sock.
[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
{{- if .SandboxImage}}
    # No public registry is reachable: the pause image comes from the loopback registry.
    sandbox_image = "{{.SandboxImage}}"
{{- end}}
    # This VM does not allow lowering oom_score_adj; without this every RunPodSandbox fails with
    # "can't get final child's PID from pipe: EOF".
    restrict_oom_score_adj = true
    stats_collect_period = {{.StatsSeconds}}
    max_concurrent_downloads = {{.MaxConcurrentDownloads}}
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "{{.Snapshotter}}"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          # runc's state of this containerd only, so cleanup finds exactly its containers.
          Root = "{{.Dir}}/runc"
    # No CNI: pods use host networking; the empty directories keep the host's CNI config out.
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{{.Dir}}/cni"
      conf_dir = "{{.Dir}}/cni"
  [plugins."io.containerd.internal.v1.opt"]
    path = "{{.Dir}}/opt"
`))

func (c *Containerd) writeConfig() error {
	var b bytes.Buffer
	err := configTemplate.Execute(&b, struct {
		Dir, SandboxImage, Snapshotter       string
		StatsSeconds, MaxConcurrentDownloads int
	}{
		Dir: c.dir, SandboxImage: c.opts.SandboxImage, Snapshotter: c.snap,
		StatsSeconds:           max(1, int(c.opts.StatsCollectPeriod/time.Second)),
		MaxConcurrentDownloads: c.opts.MaxConcurrentDownloads,
	})
	if err != nil {
		return fmt.Errorf("render containerd config: %w", err)
	}
	if err := os.WriteFile(c.configPath, b.Bytes(), 0o600); err != nil {
		return fmt.Errorf("write containerd config: %w", err)
	}
	return nil
}

func requireRoot(t testing.TB) {
	t.Helper()
	if uid := os.Geteuid(); uid != 0 {
		t.Fatalf("lab: a private containerd needs root (running as uid %d); run the integration tests as root, as .ci/run does", uid)
	}
}

func requireBinary(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("lab: %s is not installed (not in PATH): %s", name, installHint)
	}
	return p
}
