package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// faultyWorker runs a real worker; on its first run it fails once fail is closed: the worker is stopped and
// Run returns an error, as a worker that fails after it started.
type faultyWorker struct {
	w    runnable
	runs *atomic.Int32
	fail <-chan struct{}
}

func (f faultyWorker) Run(ctx context.Context) error {
	if f.runs.Add(1) > 1 || f.fail == nil {
		return f.w.Run(ctx)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.w.Run(wctx) }()
	select {
	case <-f.fail:
		cancel()
		<-done
		return errors.New("injected fault")
	case err := <-done:
		return err
	}
}

// hollowRun runs `imagefleet hollow args...` in this process (so wrapWorker applies) against natsURL.
func hollowRun(ctx context.Context, t *testing.T, stderr *bustest.SyncBuffer, args ...string) error {
	prev := slog.Default()
	t.Cleanup(func() { slog.SetDefault(prev) })
	root := newRootCmd()
	root.SetArgs(append([]string{"hollow"}, args...))
	root.SetOut(stderr)
	root.SetErr(stderr)
	return root.ExecuteContext(ctx)
}

// stopHollow cancels a hollowRun and waits for it to return without an error.
func stopHollow(t *testing.T, cancel context.CancelFunc, done <-chan error, stderr *bustest.SyncBuffer) {
	t.Helper()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("hollow: %v\n%s", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("hollow did not stop within 30s\n%s", stderr.String())
	}
}

// TestHollowRestartsAFailedAgent: a hollow node whose worker fails after it started (the real detector,
// stopped by a fault) is started again after the 1 s backoff, its whole agent rebuilt (a new start time in
// its heartbeat record), while the other nodes' agents run on untouched; a node that never starts (its data
// directory unusable) stops the whole process with its error.
func TestHollowRestartsAFailedAgent(t *testing.T) {
	srv := bustest.Server(t)
	b := bustest.Connect(t, srv)
	runs := map[string]*atomic.Int32{}
	var mu sync.Mutex
	fail := make(chan struct{})
	const faulty = "hollow-00001"
	wrapWorker = func(node, worker string, w runnable) runnable {
		if worker != "detector" {
			return w
		}
		mu.Lock()
		defer mu.Unlock()
		if runs[node] == nil {
			runs[node] = &atomic.Int32{}
		}
		f := faultyWorker{w: w, runs: runs[node]}
		if node == faulty {
			f.fail = fail
		}
		return f
	}
	t.Cleanup(func() { wrapWorker = nil })
	runsOf := func(node string) int32 {
		mu.Lock()
		defer mu.Unlock()
		if runs[node] == nil {
			return 0
		}
		return runs[node].Load()
	}

	t.Run("worker fails after start", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		var stderr bustest.SyncBuffer
		done := make(chan error, 1)
		go func() {
			done <- hollowRun(ctx, t, &stderr, "--nodes", "3", "--nats", srv.ClientURL(), "--workers", "detector,heartbeat",
				"--data-dir", t.TempDir(), "--images-per-node", "2")
		}()
		reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{})
		if err != nil {
			t.Fatal(err)
		}
		started := map[string]time.Time{}
		readRegistry := func() (map[string]events.NodeStatus, error) {
			nodes, err := reg.Nodes(t.Context())
			out := map[string]events.NodeStatus{}
			for _, n := range nodes {
				out[n.Node] = n
			}
			return out, err
		}
		bustest.Eventually(t, "three hollow nodes in the registry", 30*time.Second, func() error {
			if reg, err = fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{}); err != nil {
				return err
			}
			nodes, err := readRegistry()
			if err != nil || len(nodes) != 3 {
				return fmt.Errorf("%d nodes (%v): %s", len(nodes), err, stderr.String())
			}
			for name, n := range nodes {
				// A node whose thin heartbeat came before its full record is listed without its start
				// time (Registry.List): the start time compared below is the full record's.
				if n.Started.IsZero() {
					return fmt.Errorf("%s listed before its full record", name)
				}
			}
			for name, n := range nodes {
				started[name] = n.Started
			}
			return nil
		})
		close(fail)
		bustest.Eventually(t, faulty+" restarted", 30*time.Second, func() error {
			nodes, err := readRegistry()
			if err != nil {
				return err
			}
			if n := nodes[faulty]; !n.Started.After(started[faulty]) || n.State != events.NodeReady {
				return fmt.Errorf("%s: started %v (before: %v), %s", faulty, n.Started, started[faulty], n.State)
			}
			return nil
		})
		if got := runsOf(faulty); got != 2 {
			t.Errorf("%s's detector ran %d times, want 2 (the first, failed; the restart)", faulty, got)
		}
		nodes, err := readRegistry()
		if err != nil {
			t.Fatal(err)
		}
		for _, node := range []string{"hollow-00000", "hollow-00002"} {
			if got := runsOf(node); got != 1 {
				t.Errorf("%s's detector ran %d times, want 1", node, got)
			}
			if n := nodes[node]; !n.Started.Equal(started[node]) || n.State != events.NodeReady {
				t.Errorf("%s: started %v (before: %v), %s: its agent was touched", node, n.Started, started[node], n.State)
			}
		}
		stopHollow(t, cancel, done, &stderr)
		out := stderr.String()
		if !strings.Contains(out, `msg="hollow agent stopped, restarting" node=`+faulty+` err="detector: injected fault" after=1s`) {
			t.Errorf("no restart logged for %s:\n%s", faulty, out)
		}
		if strings.Count(out, "hollow agent stopped, restarting") != 1 || !strings.Contains(out, "hollow: 3 agents stopped (1 restarts after a failure)") {
			t.Errorf("want one restart in all:\n%s", out)
		}
	})

	t.Run("node never starts", func(t *testing.T) {
		// With journals on, hollow-00002's data directory is a file: its journal cannot open, so its agent
		// never runs.
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "hollow-00002"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
		defer cancel()
		var stderr bustest.SyncBuffer
		err := hollowRun(ctx, t, &stderr, "--nodes", "3", "--nats", srv.ClientURL(), "--workers", "detector,heartbeat",
			"--data-dir", dir, "--no-journal=false")
		if ctx.Err() != nil {
			t.Fatalf("hollow ran on with a node that never started\n%s", stderr.String())
		}
		if err == nil || !strings.HasPrefix(err.Error(), "hollow-00002: ") {
			t.Fatalf("hollow returned %v, want hollow-00002's error\n%s", err, stderr.String())
		}
		t.Logf("hollow: %v", err)
		if strings.Contains(stderr.String(), "restarting") {
			t.Errorf("a node that never ran was restarted:\n%s", stderr.String())
		}
	})
}

// TestHollowRetriesAnAgentThatCouldNotConnect: a server that accepts the hollow process's setup connection
// but refuses one of its agents' (its max_connections reached, as a cluster too busy to accept a dial) does
// not stop the process: the agent tries again with the restart backoff and runs once the server has room.
// Before, the agent's failed connect after --timeout stopped every other node (a 10,000-node run lost its
// fleet to one dial timeout).
func TestHollowRetriesAnAgentThatCouldNotConnect(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	// Three clients at most: two held by this test until it lets go, then the setup connection and the two
	// agents one after the other.
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("listen: \"127.0.0.1:-1\"\nmax_connections: 3\njetstream {\n  store_dir: %q\n}\n",
		filepath.Join(dir, "js"))), 0o600); err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	var holders []*bus.Bus
	for range 2 {
		hb, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{Name: "slot-holder"})
		if err != nil {
			t.Fatal(err)
		}
		holders = append(holders, hb)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var stderr bustest.SyncBuffer
	done := make(chan error, 1)
	go func() {
		done <- hollowRun(ctx, t, &stderr, "--nodes", "2", "--nats", srv.ClientURL(), "--workers", "heartbeat",
			"--data-dir", t.TempDir(), "--timeout", "2s")
	}()
	// One slot is free: the setup connection and then the first agent take it; the second agent is
	// refused for longer than --timeout.
	bustest.Eventually(t, "an agent refused and trying again", 30*time.Second, func() error {
		select {
		case err := <-done:
			t.Fatalf("hollow stopped with a node refused by a busy server: %v\n%s", err, stderr.String())
		default:
		}
		if !strings.Contains(stderr.String(), `msg="hollow agent could not connect, trying again"`) {
			return errors.New("no retry logged yet")
		}
		return nil
	})
	for _, hb := range holders {
		hb.Close()
	}
	bustest.Eventually(t, "both agents running", 60*time.Second, func() error {
		select {
		case err := <-done:
			t.Fatalf("hollow stopped: %v\n%s", err, stderr.String())
		default:
		}
		if !strings.Contains(stderr.String(), "hollow: 2 agents running") {
			return errors.New("not yet")
		}
		return nil
	})
	stopHollow(t, cancel, done, &stderr)
	if out := stderr.String(); strings.Contains(out, "restarting") || !strings.Contains(out, "hollow: 2 agents stopped (0 restarts after a failure)") {
		t.Errorf("a connect retry is not a restart:\n%s", out)
	}
}
