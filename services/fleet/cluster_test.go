package fleet_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestMain: the cluster test runs its servers as child processes (bustest.Processes), this test binary
// started as a nats-server, so it can kill one with SIGKILL, as a crash does (an in-process Shutdown steps
// its leaders down first).
func TestMain(m *testing.M) {
	testenv.MustCheck()
	bustest.ServeIfChild()
	os.Exit(m.Run())
}

// TestRolloutExactlyOnceAcrossAServerLoss runs a GC rollout over 400 nodes on a three-server cluster (R3
// rollout stream) and SIGKILLs the rollout stream's leader in the middle of it, while 64 nodes are in
// flight (their claims, requests and outcome records crossing the killed server). Scripted GC responders
// count the passes per node, answering a repeated request id from memory as the real executor does. Every
// node must be acted on exactly once, none counted failed (a node given up on while it acted, or never
// asked), every claim and outcome recorded, and the rollout run again must act on nobody.
func TestRolloutExactlyOnceAcrossAServerLoss(t *testing.T) {
	defer fleet.SetGCAttemptTimeout(3 * time.Second)() // a reply lost with the server is asked again sooner
	// A three-server cluster with JetStream (the layout of deploy/nats/cluster), in child processes.
	servers := bustest.StartCluster(t, 3, bustest.Processes(), bustest.ClusterName("fleet-test"))
	connect := servers.Connect
	setup, agents := connect("setup"), connect("responders")
	bustest.Eventually(t, "an R3 rollout stream", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		return fleet.EnsureRolloutStream(ctx, setup, 3)
	})
	victim := -1
	bustest.Eventually(t, "the rollout stream's leader", time.Minute, func() error {
		info, err := setup.Stream(t.Context(), events.RolloutStream)
		if err != nil {
			return err
		}
		if victim = servers.Index(info.Leader); victim < 0 {
			return fmt.Errorf("leader %q is none of the servers", info.Leader)
		}
		return nil
	})
	victimName, victimExited := servers.Name(victim), servers.Exited(victim)
	// The orchestrator connected to the victim too (the client picks a server at random): the kill then
	// loses its connection as well as the stream's leader, the hardest case for its claims and outcomes.
	var orch *bus.Bus
	for i := 0; orch == nil; i++ {
		b := connect(fmt.Sprintf("orchestrator-%d", i))
		if b.ServerName() == victimName || i == 20 {
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
					servers.Kill(victim)
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
	case <-victimExited:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s still runs after SIGKILL", victimName)
	}
	t.Logf("killed %s (the rollout stream's leader, the orchestrator's server: %v) after %d of %d outcomes; rollout took %v; %d GC requests for %d nodes",
		victimName, orchServer == victimName, killedAt.Load(), n, took.Round(time.Millisecond), s.requests.Load(), n)
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
