package bustest

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// clusterConfigEnv, set, makes a test binary a nats-server with that configuration file instead of running
// its tests (ServeIfChild): how a Cluster of Processes runs its servers. Not IMAGEFLEET_: set by the cluster
// for its children, never by a person, it is no knob of internal/testenv.
const clusterConfigEnv = "BUSTEST_NATS_CONFIG"

// ServeIfChild makes the test binary a nats-server, until SIGTERM, when a Cluster of Processes started it as
// one of its servers; otherwise it returns at once. A package whose tests use Processes calls it first in its
// TestMain (before testing runs: a child has no testing.TB).
func ServeIfChild() {
	conf := os.Getenv(clusterConfigEnv)
	if conf == "" {
		return
	}
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	srv.Shutdown()
	os.Exit(0)
}

// ClusterOption configures StartCluster.
type ClusterOption func(*clusterConfig)

type clusterConfig struct {
	name      string
	processes bool
	monitor   bool
}

// ClusterName names the cluster (default "bustest"); its servers are <name>-1 to <name>-n.
func ClusterName(name string) ClusterOption { return func(c *clusterConfig) { c.name = name } }

// Processes runs the servers as child processes of the test binary, so Kill is a SIGKILL (a crash), which an
// in-process Shutdown is not: it hands its leaderships over first. The package's TestMain must call
// ServeIfChild first.
func Processes() ClusterOption { return func(c *clusterConfig) { c.processes = true } }

// Monitoring gives each server an HTTP monitoring endpoint (MonitorURL: /jsz, /varz...).
func Monitoring() ClusterOption { return func(c *clusterConfig) { c.monitor = true } }

// Cluster is a JetStream cluster of nats-servers on free loopback ports (the layout of deploy/nats/cluster:
// every server routes to all the others), their stores in the test's temp dir, stopped when the test ends.
// A server stopped (Stop, Kill) can be started again (Start) on its store.
type Cluster struct {
	tb       testing.TB
	cfg      clusterConfig
	dir      string
	names    []string
	confs    []string
	urls     []string
	monitors []string

	mu    sync.Mutex
	srvs  []*bus.Server // in this process: nil while stopped
	procs []*clusterProc
}

// clusterProc is a server in a child process; done is closed once it exited.
type clusterProc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// StartCluster starts a cluster of n servers (see Cluster) and returns once each was started (in this
// process: ready for connections; as processes: started, the clients' connect retries wait for them).
func StartCluster(tb testing.TB, n int, opts ...ClusterOption) *Cluster {
	tb.Helper()
	cfg := clusterConfig{name: "bustest"}
	for _, o := range opts {
		o(&cfg)
	}
	c := &Cluster{tb: tb, cfg: cfg, dir: tb.TempDir(), srvs: make([]*bus.Server, n), procs: make([]*clusterProc, n)}
	client, route := make([]int, n), make([]int, n)
	var routes []string
	for i := range n {
		client[i], route[i] = testport.Free(tb), testport.Free(tb)
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", route[i]))
	}
	for i := range n {
		name := fmt.Sprintf("%s-%d", cfg.name, i+1)
		conf := fmt.Sprintf("server_name: %s\nlisten: 127.0.0.1:%d\n", name, client[i])
		monitor := ""
		if cfg.monitor {
			port := testport.Free(tb)
			conf += fmt.Sprintf("http: 127.0.0.1:%d\n", port)
			monitor = fmt.Sprintf("http://127.0.0.1:%d", port)
		}
		conf += fmt.Sprintf("jetstream { store_dir: %q }\n"+
			"cluster {\n  name: %s\n  listen: 127.0.0.1:%d\n  routes: [%s]\n  connect_retries: 120\n}\n",
			filepath.Join(c.dir, name), cfg.name, route[i], strings.Join(routes, ", "))
		p := filepath.Join(c.dir, name+".conf")
		if err := os.WriteFile(p, []byte(conf), 0o600); err != nil {
			tb.Fatal(err)
		}
		c.names, c.confs = append(c.names, name), append(c.confs, p)
		c.urls = append(c.urls, fmt.Sprintf("nats://127.0.0.1:%d", client[i]))
		c.monitors = append(c.monitors, monitor)
	}
	// In this process each start waits for its server to be ready, which a cluster member is once it has
	// routes: they start together.
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- c.start(i) }()
	}
	var failed []error
	for range n {
		if err := <-errs; err != nil {
			failed = append(failed, err)
		}
	}
	tb.Cleanup(func() {
		for i := range n {
			c.Stop(i)
		}
		if tb.Failed() && cfg.processes {
			c.logServers()
		}
	})
	if len(failed) > 0 {
		tb.Fatal(failed)
	}
	return c
}

// N is the number of servers.
func (c *Cluster) N() int { return len(c.names) }

// URLs is the client URLs of every server, comma-separated (what bus.Connect takes).
func (c *Cluster) URLs() string { return strings.Join(c.urls, ",") }

// URL is server i's client URL.
func (c *Cluster) URL(i int) string { return c.urls[i] }

// Name is server i's name (<cluster>-<i+1>).
func (c *Cluster) Name(i int) string { return c.names[i] }

// Index is the position of the server named name, or -1.
func (c *Cluster) Index(name string) int {
	for i, n := range c.names {
		if n == name {
			return i
		}
	}
	return -1
}

// MonitorURL is server i's HTTP monitoring endpoint (with Monitoring; "" without).
func (c *Cluster) MonitorURL(i int) string { return c.monitors[i] }

// Start starts server i again on its store (it must be stopped).
func (c *Cluster) Start(i int) {
	c.tb.Helper()
	if err := c.start(i); err != nil {
		c.tb.Fatal(err)
	}
}

func (c *Cluster) start(i int) error {
	if c.cfg.processes {
		logf, err := os.OpenFile(filepath.Join(c.dir, c.names[i]+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			return err
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), clusterConfigEnv+"="+c.confs[i])
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = childAttr() // never outlive the test
		if err := cmd.Start(); err != nil {
			logf.Close()
			return fmt.Errorf("server %s: %w", c.names[i], err)
		}
		p := &clusterProc{cmd: cmd, done: make(chan struct{})}
		go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
		c.mu.Lock()
		c.procs[i] = p
		c.mu.Unlock()
		return nil
	}
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: c.confs[i]})
	if err != nil {
		return fmt.Errorf("server %s: %w", c.names[i], err)
	}
	c.mu.Lock()
	c.srvs[i] = srv
	c.mu.Unlock()
	return nil
}

// Stop stops server i, as an operator does (in this process: Shutdown; a process: SIGTERM, then SIGKILL after
// 10 s), and returns once it is gone. Stopping a stopped server does nothing.
func (c *Cluster) Stop(i int) {
	c.mu.Lock()
	srv, p := c.srvs[i], c.procs[i]
	c.srvs[i], c.procs[i] = nil, nil
	c.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
	}
	if p != nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		t := time.NewTimer(10 * time.Second)
		defer t.Stop()
		select {
		case <-p.done:
		case <-t.C:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
}

// Kill kills server i's process with SIGKILL (with Processes only), as a crash does; Exited says when it is
// gone.
func (c *Cluster) Kill(i int) {
	c.mu.Lock()
	p := c.procs[i]
	c.mu.Unlock()
	if !c.cfg.processes {
		c.tb.Error("bustest.Cluster.Kill needs Processes")
		return
	}
	if p != nil {
		_ = p.cmd.Process.Kill()
	}
}

// Exited is closed once server i's process (with Processes) has exited; nil when it is not running.
func (c *Cluster) Exited(i int) <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p := c.procs[i]; p != nil {
		return p.done
	}
	return nil
}

// Connect connects a bus named name to the cluster, its streams with a replica per server; it is closed when
// the test ends.
func (c *Cluster) Connect(name string) *bus.Bus {
	c.tb.Helper()
	b, err := bus.Connect(c.tb.Context(), c.URLs(), bus.Options{Name: name, Replicas: c.N()})
	if err != nil {
		c.tb.Fatal(err)
	}
	c.tb.Cleanup(b.Close)
	return b
}

// logServers logs the end of each server process's output, for a failed test.
func (c *Cluster) logServers() {
	for _, name := range c.names {
		out, err := os.ReadFile(filepath.Join(c.dir, name+".log"))
		if err != nil {
			continue
		}
		if len(out) > 4096 {
			out = out[len(out)-4096:]
		}
		c.tb.Logf("server %s's output (its end):\n%s", name, out)
	}
}
