package fleet_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/internal/testport"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// natsConfigEnv, when set, makes this test binary a nats-server (bus.StartServer with that configuration
// file) instead of running tests: the cluster test runs its servers as child processes, so it can kill one
// with SIGKILL, as a crash does (an in-process Shutdown steps its leaders down first).
const natsConfigEnv = "IMAGEFLEET_FLEET_TEST_NATS_CONFIG"

func TestMain(m *testing.M) {
	testenv.MustCheck()
	if conf := os.Getenv(natsConfigEnv); conf != "" { // read before testing runs: no testing.TB yet
		os.Exit(runNATSServer(conf))
	}
	os.Exit(m.Run())
}

func runNATSServer(conf string) int {
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	srv.Shutdown()
	return 0
}

// natsServer is one server of a test cluster, a child process.
type natsServer struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// startNATSCluster starts a three-server cluster with JetStream (the layout of deploy/nats/cluster, on free
// ports) as child processes, and returns its servers and client URLs (comma-separated).
func startNATSCluster(t *testing.T) ([]*natsServer, string) {
	t.Helper()
	dir := t.TempDir()
	var clientPorts, routePorts [3]int
	var routes []string
	for i := range 3 {
		clientPorts[i], routePorts[i] = testport.Free(t), testport.Free(t)
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[i]))
	}
	var servers []*natsServer
	var urls []string
	for i := range 3 {
		name := fmt.Sprintf("fleet-test-%d", i+1)
		conf := fmt.Sprintf(`server_name: %s
listen: 127.0.0.1:%d
jetstream { store_dir: %q }
cluster {
  name: fleet-test
  listen: 127.0.0.1:%d
  routes: [%s]
  connect_retries: 120
}
`, name, clientPorts[i], filepath.Join(dir, name), routePorts[i], strings.Join(routes, ", "))
		path := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		logf, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), natsConfigEnv+"="+path)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the test
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		s := &natsServer{name: name, cmd: cmd, done: make(chan struct{})}
		go func() { _ = cmd.Wait(); logf.Close(); close(s.done) }()
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-s.done:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-s.done
			}
		})
		servers = append(servers, s)
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", clientPorts[i]))
	}
	return servers, strings.Join(urls, ",")
}

// TestRolloutExactlyOnceAcrossAServerLoss runs a GC rollout over 400 nodes on a three-server cluster (R3
// rollout stream) and SIGKILLs the rollout stream's leader in the middle of it, while 64 nodes are in
// flight (their claims, requests and outcome records crossing the killed server). Scripted GC responders
// count the passes per node, answering a repeated request id from memory as the real executor does. Every
// node must be acted on exactly once, none counted failed (a node given up on while it acted, or never
// asked), every claim and outcome recorded, and the rollout run again must act on nobody.
func TestRolloutExactlyOnceAcrossAServerLoss(t *testing.T) {
	defer fleet.SetGCAttemptTimeout(3 * time.Second)() // a reply lost with the server is asked again sooner
	servers, url := startNATSCluster(t)
	connect := func(name string) *bus.Bus {
		b, err := bus.Connect(t.Context(), url, bus.Options{Name: name, Replicas: 3})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(b.Close)
		return b
	}
	setup, agents := connect("setup"), connect("responders")
	bustest.Eventually(t, "an R3 rollout stream", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		return fleet.EnsureRolloutStream(ctx, setup, 3)
	})
	var victim *natsServer
	bustest.Eventually(t, "the rollout stream's leader", time.Minute, func() error {
		info, err := setup.Stream(t.Context(), events.RolloutStream)
		if err != nil {
			return err
		}
		for _, s := range servers {
			if s.name == info.Leader {
				victim = s
				return nil
			}
		}
		return fmt.Errorf("leader %q is none of the servers", info.Leader)
	})
	// The orchestrator connected to the victim too (the client picks a server at random): the kill then
	// loses its connection as well as the stream's leader, the hardest case for its claims and outcomes.
	var orch *bus.Bus
	for i := 0; orch == nil; i++ {
		b := connect(fmt.Sprintf("orchestrator-%d", i))
		if b.ServerName() == victim.name || i == 20 {
			orch = b
		}
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	const n = 400
	s := newScriptedGC(4)
	s.delay = 40 * time.Millisecond
	s.serve(t, ctx, agents)
	var nodes []string
	for i := range n {
		nodes = append(nodes, fmt.Sprintf("node-%04d", i))
	}
	bustest.Eventually(t, "the scripted GC answers", 30*time.Second, func() error {
		var res events.GCResult
		return agents.Request(t.Context(), events.CommandSubject("probe", events.VerbGC), events.GCRequest{ID: "probe.probe", DryRun: true}, &res)
	})

	orchServer := orch.ServerName()
	req := events.GCRequest{ID: "gc-server-loss", AllUnused: true}
	var killedAt atomic.Int64
	var once sync.Once
	cfg := fleet.RolloutConfig{ID: req.ID, Kind: events.RolloutGC, Nodes: nodes, GC: &req, MaxInFlight: 64,
		NodeTimeout: 60 * time.Second, Replicas: 3,
		Progress: func(p fleet.Progress) {
			if p.Node != nil && p.Done >= 200 {
				once.Do(func() {
					killedAt.Store(int64(p.Done))
					_ = victim.cmd.Process.Kill()
				})
			}
		},
		Results: func(events.RolloutNodeResult) {}}
	r, err := fleet.NewRollout(cfg, orch, fleet.GCAction(orch, req))
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	res, err := r.Run(t.Context())
	took := time.Since(began)
	if err != nil {
		t.Fatalf("rollout: %v", err)
	}
	select {
	case <-victim.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s still runs after SIGKILL", victim.name)
	}
	t.Logf("killed %s (the rollout stream's leader, the orchestrator's server: %v) after %d of %d outcomes; rollout took %v; %d GC requests for %d nodes",
		victim.name, orchServer == victim.name, killedAt.Load(), n, took.Round(time.Millisecond), s.requests.Load(), n)
	if k := killedAt.Load(); k == 0 || k >= n {
		t.Fatalf("the server was not killed mid-rollout (after %d outcomes)", k)
	}
	if res.Succeeded != n || res.FailedTotal() != 0 || res.NotStarted != 0 {
		t.Errorf("result: %d succeeded, %d failed (%v), %d not started", res.Succeeded, res.FailedTotal(), res.Failed, res.NotStarted)
	}
	checkPasses := func(when string) {
		passes := s.passesOf()
		for _, node := range nodes {
			if p := passes[node]; p != 1 {
				t.Errorf("%s: node %s had %d GC passes, want 1", when, node, p)
			}
		}
	}
	checkPasses("after the rollout")

	// Every claim and outcome is recorded, by one run, on the two servers left.
	lctx, lcancel := context.WithTimeout(t.Context(), time.Minute)
	defer lcancel()
	_, claims, results, err := fleet.LoadRollout(lctx, orch, req.ID)
	if err != nil {
		t.Fatal(err)
	}
	owners := map[string]bool{}
	for _, c := range claims {
		owners[c.Owner] = true
	}
	okResults := 0
	for _, nr := range results {
		if nr.OK {
			okResults++
		}
	}
	if len(claims) != n || len(results) != n || okResults != n || len(owners) != 1 {
		t.Errorf("recorded: %d claims by %d runs, %d outcomes (%d ok); want %d, 1, %d, %d", len(claims), len(owners), len(results), okResults, n, n, n)
	}

	// Run again: every node's outcome is carried over, nobody is acted on.
	cfg.Progress = nil
	r2, err := fleet.NewRollout(cfg, orch, fleet.GCAction(orch, req))
	if err != nil {
		t.Fatal(err)
	}
	again, err := r2.Run(lctx)
	if err != nil {
		t.Fatalf("rollout again: %v", err)
	}
	if again.Succeeded != n || again.FailedTotal() != 0 {
		t.Errorf("rollout again: %d succeeded, %d failed", again.Succeeded, again.FailedTotal())
	}
	checkPasses("after the rollout ran again")
}
