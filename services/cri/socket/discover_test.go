package socket

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/internal/testenv"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// An IMAGEFLEET_* variable no test reads (a mistyped knob) stops the run before any test: docs/testing.md.
func init() { testenv.MustCheck() }

// newRoot returns a directory to use as the host's / . It is short, unlike t.TempDir(), because a unix
// socket's path holds at most 107 bytes and the MicroK8s candidate alone takes 45.
func newRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ifs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func mkdirFor(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
}

// version is a CRI runtime that answers only Version, which is all discovery asks.
type version struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	name string
}

func (v version) Version(context.Context, *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	return &runtimeapi.VersionResponse{Version: "0.1.0", RuntimeName: v.name, RuntimeVersion: "v9.9.9", RuntimeApiVersion: "v1"}, nil
}

// serve serves gRPC on a unix socket at path until the test ends; cri says whether it serves CRI's
// RuntimeService (answering Version with runtime name) or no service at all.
func serve(t *testing.T, path, name string, cri bool) {
	t.Helper()
	mkdirFor(t, path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	if cri {
		runtimeapi.RegisterRuntimeServiceServer(srv, version{name: name})
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
}

// silent listens at path and never accepts: the kernel completes connections into the backlog, and nobody
// ever answers on them (a hung runtime).
func silent(t *testing.T, path string) {
	t.Helper()
	mkdirFor(t, path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
}

// stale leaves a socket file with nothing listening on it, as a runtime killed without cleanup does.
func stale(t *testing.T, path string) {
	t.Helper()
	mkdirFor(t, path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := lis.Close(); err != nil {
		t.Fatal(err)
	}
}

func regular(t *testing.T, path string) {
	t.Helper()
	mkdirFor(t, path)
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

func directory(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
}

const (
	k3s        = "/run/k3s/containerd/containerd.sock"
	containerd = "/run/containerd/containerd.sock"
	crio       = "/run/crio/crio.sock"
)

func TestCandidates(t *testing.T) {
	cands := Candidates()
	var paths []string
	for _, c := range cands {
		if !filepath.IsAbs(c.Path) || c.Runtime == "" {
			t.Errorf("candidate %+v: want a runtime and an absolute path", c)
		}
		if slices.Contains(paths, c.Path) {
			t.Errorf("%s listed twice", c.Path)
		}
		paths = append(paths, c.Path)
	}
	for _, want := range []string{k3s, "/run/k0s/containerd.sock", "/var/snap/microk8s/common/run/containerd.sock",
		containerd, crio, "/var/run/crio/crio.sock", "/run/cri-dockerd.sock", "/var/run/cri-dockerd.sock"} {
		if !slices.Contains(paths, want) {
			t.Errorf("no candidate %s", want)
		}
	}
	// A distribution's own socket is tried before the generic one, which may be a containerd no kubelet uses.
	generic := slices.Index(paths, containerd)
	for _, own := range []string{k3s, "/run/k0s/containerd.sock", "/var/snap/microk8s/common/run/containerd.sock"} {
		if slices.Index(paths, own) > generic {
			t.Errorf("%s is tried after %s", own, containerd)
		}
	}
	if slices.Contains(paths, "/system/run/containerd/containerd.sock") {
		t.Error("Talos's system containerd is a candidate: it holds no pod images")
	}
}

func TestDiscoverNothingThere(t *testing.T) {
	root := newRoot(t)
	start := time.Now()
	_, err := Discover(t.Context(), Options{Root: root})
	elapsed := time.Since(start)
	var nf *NotFoundError
	if !errors.As(err, &nf) {
		t.Fatalf("err = %v, want a *NotFoundError", err)
	}
	if len(nf.Attempts) != len(Candidates()) {
		t.Errorf("%d attempts, want one per candidate (%d)", len(nf.Attempts), len(Candidates()))
	}
	msg := err.Error()
	for _, c := range Candidates() {
		if want := filepath.Join(root, c.Path) + " (" + c.Runtime + "): does not exist"; !strings.Contains(msg, want) {
			t.Errorf("error does not say %q:\n%s", want, msg)
		}
	}
	if !strings.Contains(msg, "not mounted into the agent's pod") {
		t.Errorf("error does not say what to do when nothing exists:\n%s", msg)
	}
	if !errors.Is(err, ErrNotExist) || errors.Is(err, ErrPermission) {
		t.Errorf("errors.Is: want ErrNotExist only, got %v", err)
	}
	// Nothing exists, so nothing is dialed: the answer is immediate, far below any probe timeout.
	if elapsed > time.Second {
		t.Errorf("took %v with no socket to probe", elapsed)
	}
}

func TestDiscoverFinds(t *testing.T) {
	root := newRoot(t)
	serve(t, root+containerd, "containerd", true)
	f, err := Discover(t.Context(), Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	want := Found{Endpoint: "unix://" + root + containerd, Candidate: Candidate{Runtime: "containerd", Path: containerd},
		RuntimeName: "containerd", RuntimeVersion: "v9.9.9"}
	if f.Endpoint != want.Endpoint || f.Candidate != want.Candidate || f.RuntimeName != want.RuntimeName ||
		f.RuntimeVersion != want.RuntimeVersion || len(f.Skipped) != 0 {
		t.Errorf("found %+v, want %+v", f, want)
	}
}

func TestUnder(t *testing.T) {
	for _, tt := range []struct{ root, want string }{
		{"", containerd},
		{"/", containerd},
		{"/host", "/host" + containerd},
		{"/host/", "/host" + containerd},
	} {
		if got := under(tt.root, containerd); got != tt.want {
			t.Errorf("under(%q) = %s, want %s", tt.root, got, tt.want)
		}
	}
}

func TestDiscoverPrefersTheDistributionsSocket(t *testing.T) {
	root := newRoot(t)
	serve(t, root+containerd, "containerd", true)
	serve(t, root+k3s, "k3s-containerd", true)
	serve(t, root+crio, "cri-o", true)
	f, err := Discover(t.Context(), Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	if f.Endpoint != "unix://"+root+k3s || f.RuntimeName != "k3s-containerd" || f.Candidate.Runtime != "k3s, RKE2" {
		t.Errorf("found %+v, want k3s's socket", f)
	}
}

// TestDiscoverPassesOver: a socket ahead of the working one that is not usable is passed over, and reported
// in Found.Skipped with its cause.
func TestDiscoverPassesOver(t *testing.T) {
	tests := []struct {
		name     string
		make     func(t *testing.T, path string)
		sentinel error
		says     string
	}{
		{"stale socket", stale, ErrRefused, "connection refused: nothing listens on it"},
		{"regular file", regular, ErrNotSocket, "not a socket but a regular file"},
		{"directory", directory, ErrNotSocket, "not a socket but a directory"},
		{"gRPC without CRI", func(t *testing.T, p string) { serve(t, p, "", false) }, ErrNotCRI, "does not serve CRI v1"},
		{"never answers", silent, ErrNoAnswer, "no answer in 300ms: it accepted the connection but did not answer CRI Version"},
		{"not gRPC", closes, ErrNotCRI, "does not speak gRPC"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			tt.make(t, root+k3s)
			serve(t, root+containerd, "containerd", true)
			f, err := Discover(t.Context(), Options{Root: root, Timeout: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if f.Endpoint != "unix://"+root+containerd {
				t.Fatalf("found %s, want the containerd socket", f.Endpoint)
			}
			if len(f.Skipped) != 1 || f.Skipped[0].Path != root+k3s {
				t.Fatalf("skipped %+v, want only k3s's socket", f.Skipped)
			}
			if err := f.Skipped[0].Err; !errors.Is(err, tt.sentinel) || !strings.Contains(err.Error(), tt.says) {
				t.Errorf("k3s's socket: %v, want %v saying %q", err, tt.sentinel, tt.says)
			}
		})
	}
}

// closes accepts connections and closes them at once, as a server of another protocol that dislikes gRPC's
// preface would.
func closes(t *testing.T, path string) {
	t.Helper()
	mkdirFor(t, path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = lis.Close(); <-done })
}

// TestDiscoverReportsEveryCause: nothing answers; the error names each path with its own cause, and the
// probes ran at once: six sockets that never answer cost one timeout, not six.
func TestDiscoverReportsEveryCause(t *testing.T) {
	root := newRoot(t)
	stale(t, root+k3s)
	regular(t, root+"/run/k0s/containerd.sock")
	serve(t, root+"/var/snap/microk8s/common/run/containerd.sock", "", false)
	for _, p := range []string{containerd, crio, "/run/cri-dockerd.sock", "/var/lib/k0s/run/containerd.sock"} {
		silent(t, root+p)
	}
	const timeout = time.Second
	start := time.Now()
	_, err := Discover(t.Context(), Options{Root: root, Timeout: timeout})
	elapsed := time.Since(start)
	var nf *NotFoundError
	if !errors.As(err, &nf) {
		t.Fatalf("err = %v, want a *NotFoundError", err)
	}
	msg := err.Error()
	for _, want := range []string{
		root + k3s + " (k3s, RKE2): connection refused",
		root + "/run/k0s/containerd.sock (k0s): not a socket but a regular file",
		root + "/var/snap/microk8s/common/run/containerd.sock (MicroK8s): not a CRI runtime",
		root + containerd + " (containerd): no answer in 1s",
		root + crio + " (CRI-O): no answer in 1s",
		root + "/run/cri-dockerd.sock (cri-dockerd): no answer in 1s",
		root + "/var/lib/k0s/run/containerd.sock (k0s (older releases)): no answer in 1s",
		root + "/var/run/cri-dockerd.sock (cri-dockerd): does not exist",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("error does not say %q:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, "not mounted into the agent's pod") {
		t.Errorf("error says nothing exists, but sockets do:\n%s", msg)
	}
	for _, s := range []error{ErrRefused, ErrNotSocket, ErrNotCRI, ErrNoAnswer, ErrNotExist} {
		if !errors.Is(err, s) {
			t.Errorf("errors.Is(err, %v) = false", s)
		}
	}
	// One after another the four silent sockets would take 4 s.
	if elapsed > 3*timeout {
		t.Errorf("took %v: the probes did not run at once", elapsed)
	}
}

// TestDiscoverDoesNotWaitForLaterCandidates: once the preferred socket answers, a later one that hangs is
// not waited for.
func TestDiscoverDoesNotWaitForLaterCandidates(t *testing.T) {
	root := newRoot(t)
	serve(t, root+k3s, "k3s-containerd", true)
	silent(t, root+containerd)
	const timeout = 30 * time.Second
	start := time.Now()
	f, err := Discover(t.Context(), Options{Root: root, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	if f.RuntimeName != "k3s-containerd" {
		t.Errorf("found %+v, want k3s's socket", f)
	}
	if elapsed := time.Since(start); elapsed > timeout/3 {
		t.Errorf("took %v: waited for the silent containerd socket", elapsed)
	}
}

// TestDiscoverProbesASocketOnce: with /var/run linked to /run, as on every current distribution, the
// /var/run forms are the same sockets, reported as such rather than probed again.
func TestDiscoverProbesASocketOnce(t *testing.T) {
	root := newRoot(t)
	stale(t, root+crio)
	// Relative, as on RHEL: an absolute link would leave root.
	if err := os.MkdirAll(root+"/var", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../run", root+"/var/run"); err != nil {
		t.Fatal(err)
	}
	var dials []string
	opts := Options{Root: root, Timeout: time.Second, dial: func(ctx context.Context, path string) (net.Conn, error) {
		dials = append(dials, path) // only one socket exists: one probe, no race
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}
	_, err := Discover(t.Context(), opts)
	if err == nil {
		t.Fatal("found a socket, want none")
	}
	want := root + "/var/run/crio/crio.sock (CRI-O): the same socket as " + root + crio + ": connection refused"
	if !strings.Contains(err.Error(), want) {
		t.Errorf("error does not say %q:\n%v", want, err)
	}
	if !slices.Equal(dials, []string{root + crio}) {
		t.Errorf("dialed %q, want the CRI-O socket once", dials)
	}
}

// TestPermissionDenied: a socket the agent may not connect to is reported with its path, the cause and what
// to change. The tests run as root, which connects to a chmod 000 socket, so the connect's EACCES is
// injected here; TestPermissionDeniedByTheKernel meets the real one.
func TestPermissionDenied(t *testing.T) {
	root := newRoot(t)
	serve(t, root+containerd, "containerd", true)
	denied := func(ctx context.Context, path string) (net.Conn, error) {
		return nil, &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: path, Net: "unix"},
			Err: os.NewSyscallError("connect", syscall.EACCES)}
	}
	start := time.Now()
	_, err := Discover(t.Context(), Options{Root: root, dial: denied})
	if !errors.Is(err, ErrPermission) {
		t.Fatalf("err = %v, want ErrPermission", err)
	}
	if want := root + containerd + " (containerd): permission denied: the socket is "; !strings.Contains(err.Error(), want) {
		t.Errorf("error does not say %q:\n%v", want, err)
	}
	if elapsed := time.Since(start); elapsed > time.Second {
		t.Errorf("took %v to report a refused connect", elapsed)
	}

	_, err = Probe(t.Context(), "unix://"+root+containerd, Options{dial: denied})
	if want := "CRI socket " + root + containerd + ": permission denied: "; !errors.Is(err, ErrPermission) ||
		!strings.HasPrefix(err.Error(), want) {
		t.Errorf("Probe: %v, want an ErrPermission starting %q", err, want)
	}
}

// TestDialErrors: the connect errors that real sockets cannot be made to give on demand.
func TestDialErrors(t *testing.T) {
	root := newRoot(t)
	serve(t, root+containerd, "containerd", true)
	tests := []struct {
		name     string
		err      error
		sentinel error
		says     string
	}{
		{"backlog full", os.NewSyscallError("connect", syscall.EAGAIN), ErrNoAnswer, "queue of pending connections is full"},
		{"removed meanwhile", os.NewSyscallError("connect", syscall.ENOENT), ErrNotExist, "removed while the agent looked"},
		{"timeout", context.DeadlineExceeded, ErrNoAnswer, "no answer in 2s: connecting did not complete"},
		{"other", os.NewSyscallError("connect", syscall.ENOMEM), nil, "containerd.sock: connect: cannot allocate memory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dial := func(context.Context, string) (net.Conn, error) {
				return nil, &net.OpError{Op: "dial", Net: "unix", Err: tt.err}
			}
			_, err := Probe(t.Context(), root+containerd, Options{dial: dial})
			if err == nil || (tt.sentinel != nil && !errors.Is(err, tt.sentinel)) || !strings.Contains(err.Error(), tt.says) {
				t.Errorf("err = %v, want %v saying %q", err, tt.sentinel, tt.says)
			}
		})
	}
}

func TestPermissionHint(t *testing.T) {
	root := newRoot(t)
	sock := root + "/s.sock"
	stale(t, sock)
	tests := []struct {
		name   string
		mode   fs.FileMode
		euid   int
		groups []int
		says   string
	}{
		{"other user, group may write", 0o660, 1000, nil, "the agent runs as uid 1000: run it as root, or in group 0"},
		{"other user, owner only", 0o600, 1000, nil, "run it as root (the socket's group may not write to it)"},
		{"in the group", 0o660, 1000, []int{0}, "lets the agent (uid 1000) connect, so a security module refuses it"},
		{"root owns it", 0o660, 0, nil, "lets the agent (uid 0) connect, so a security module refuses it (SELinux"},
		{"root, no write bit", 0o000, 0, nil, "without CAP_DAC_OVERRIDE"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := os.Chmod(sock, tt.mode); err != nil {
				t.Fatal(err)
			}
			info, err := os.Stat(sock)
			if err != nil {
				t.Fatal(err)
			}
			got := permissionHint(info, tt.euid, tt.groups)
			if !strings.Contains(got, tt.says) || !strings.Contains(got, "uid 0 gid 0") {
				t.Errorf("hint %q, want it to name the owner and say %q", got, tt.says)
			}
		})
	}
}

func TestProbe(t *testing.T) {
	root := newRoot(t)
	serve(t, root+containerd, "containerd", true)
	silent(t, root+crio)
	stale(t, root+k3s)
	for _, endpoint := range []string{"unix://" + root + containerd, root + containerd} {
		f, err := Probe(t.Context(), endpoint, Options{})
		if err != nil || f.Endpoint != "unix://"+root+containerd || f.RuntimeName != "containerd" || f.Candidate != (Candidate{}) {
			t.Errorf("Probe(%s) = %+v, %v", endpoint, f, err)
		}
	}
	tests := []struct {
		endpoint string
		sentinel error
		says     string
	}{
		{"unix://" + root + k3s, ErrRefused, "CRI socket " + root + k3s + ": connection refused"},
		{"unix://" + root + "/nothing.sock", ErrNotExist, "CRI socket " + root + "/nothing.sock: does not exist"},
		{root + crio, ErrNoAnswer, "CRI socket " + root + crio + ": no answer in 200ms"},
		{"tcp://127.0.0.1:1234", nil, `CRI endpoint "tcp://127.0.0.1:1234": want unix:///path/to/socket`},
		{"run/containerd/containerd.sock", nil, "want unix:///path/to/socket or an absolute path"},
	}
	for _, tt := range tests {
		_, err := Probe(t.Context(), tt.endpoint, Options{Timeout: 200 * time.Millisecond})
		if err == nil || (tt.sentinel != nil && !errors.Is(err, tt.sentinel)) || !strings.Contains(err.Error(), tt.says) {
			t.Errorf("Probe(%s) = %v, want %v saying %q", tt.endpoint, err, tt.sentinel, tt.says)
		}
	}
}

func TestTooLongPath(t *testing.T) {
	root := newRoot(t)
	// The socket sits at a short path; a long name for it, through a symlinked directory, passes the stat and
	// is refused for its length alone.
	stale(t, root+"/s.sock")
	long := root + "/" + strings.Repeat("d", 100)
	if err := os.Symlink(root, long); err != nil {
		t.Fatal(err)
	}
	_, err := Probe(t.Context(), long+"/s.sock", Options{})
	if err == nil || !strings.Contains(err.Error(), "longer than the 107 a unix socket address holds") {
		t.Errorf("err = %v, want the path's length named", err)
	}
}

func TestCancelled(t *testing.T) {
	root := newRoot(t)
	silent(t, root+k3s)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := Discover(ctx, Options{Root: root, Timeout: 30 * time.Second})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if _, err := Discover(t.Context(), Options{Timeout: -time.Second}); err == nil {
		t.Error("a negative timeout was accepted")
	}
}

// childEnv names the socket a re-run of the test binary probes, as another user.
const childEnv = "IMAGEFLEET_SOCKET_TEST_PROBE"

// TestPermissionDeniedByTheKernel meets a real EACCES, not an injected one. As root (which connects to any
// socket whatever its mode) it runs the test binary again as nobody against a socket only root may use; as
// any other user it takes the socket's write bit away.
func TestPermissionDeniedByTheKernel(t *testing.T) {
	if path := testenv.String(t, childEnv); path != "" {
		_, err := Probe(context.Background(), path, Options{})
		fmt.Printf("probe error <<%v>>\n", err)
		return
	}
	root := newRoot(t)
	sock := root + containerd
	serve(t, sock, "containerd", true)
	if os.Geteuid() != 0 {
		if err := os.Chmod(sock, 0o000); err != nil {
			t.Fatal(err)
		}
		_, err := Probe(t.Context(), sock, Options{})
		if want := "CRI socket " + sock + ": permission denied: the socket is "; !errors.Is(err, ErrPermission) ||
			!strings.HasPrefix(err.Error(), want) {
			t.Errorf("err = %v, want an ErrPermission starting %q", err, want)
		}
		return
	}
	// nobody may reach the socket (every directory on the way is 0755) but not write to it; and it runs a
	// copy of the test binary, as go test's own directory is root's alone.
	for dir := filepath.Dir(sock); dir != filepath.Dir(root); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(sock, 0o600); err != nil {
		t.Fatal(err)
	}
	self, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(root, "socket.test")
	if err := os.WriteFile(bin, self, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), bin, "-test.run=^TestPermissionDeniedByTheKernel$")
	cmd.Env = append(os.Environ(), childEnv+"="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("run the test binary as nobody: %v\n%s", err, out)
	}
	want := "probe error <<CRI socket " + sock + ": permission denied: the socket is Srw------- uid 0 gid 0 and the agent " +
		"runs as uid 65534: run it as root (the socket's group may not write to it)>>"
	if !strings.Contains(string(out), want) {
		t.Errorf("as nobody:\n%s\nwant %s", out, want)
	}
}
