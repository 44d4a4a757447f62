package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// rolloutRecords counts rollout id's records by kind, and per node the claims and outcomes that name it.
func rolloutRecords(t *testing.T, b *bus.Bus, id string) (kinds map[string]int, claims, outcomes map[string]int) {
	t.Helper()
	kinds, claims, outcomes = map[string]int{}, map[string]int{}, map[string]int{}
	prefix := events.Prefix + ".fleet.rollout." + id + "."
	err := b.Read(t.Context(), events.RolloutStream, events.RolloutFilter(id), func(m bus.StreamMsg) error {
		kind, rest, _ := strings.Cut(strings.TrimPrefix(m.Subject, prefix), ".")
		kinds[kind]++
		switch kind {
		case events.RolloutClaimKind:
			claims[events.NodeFromToken(rest)]++
		case events.RolloutNodeKind:
			outcomes[events.NodeFromToken(rest)]++
		case events.RolloutClaimsKind:
			var c events.RolloutClaims
			if err := json.Unmarshal(m.Data, &c); err != nil {
				return err
			}
			if want := events.RolloutClaimsSubject(id, c.First); m.Subject != want {
				return fmt.Errorf("claim on nodes from %d stored on %s, want %s", c.First, m.Subject, want)
			}
			for _, n := range c.Nodes {
				claims[n]++
			}
		case events.RolloutNodesKind:
			var g events.RolloutNodes
			if err := json.Unmarshal(m.Data, &g); err != nil {
				return err
			}
			for _, nr := range g.Nodes {
				outcomes[nr.Node]++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return kinds, claims, outcomes
}

// TestRolloutClaimsRangesAndGroupsOutcomes: a rollout claims its nodes a range at a time (each batch cut
// into ranges of the plan's claim size from its first node) and records their outcomes in groups, each node
// claimed and recorded exactly once; LoadRollout and FollowRollout give a node each, as with a record per
// node, and a rerun acts on nobody.
func TestRolloutClaimsRangesAndGroupsOutcomes(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s := newScriptedGC(1)
	// The nodes of the last batch wait for each other once answered: their outcomes end together, so the
	// group commit has many to write at once (without the wait they could end one by one).
	const n = 300 // batches 1, 2, 4, 8, 16, 32, 64, 128, 45
	var mu sync.Mutex
	waiting, all := 0, make(chan struct{})
	s.serve(t, ctx, bustest.Connect(t, srv))
	req := events.GCRequest{ID: "gc-ranges-1", AllUnused: true}
	gc := fleet.GCAction(b, req)
	var nodes []string
	for i := range n {
		nodes = append(nodes, fmt.Sprintf("node-%03d", i))
	}
	act := func(ctx context.Context, node string) events.RolloutNodeResult {
		nr := gc(ctx, node)
		if node >= nodes[255] { // the last batch: its 45 outcomes are handed to the log at once
			mu.Lock()
			if waiting++; waiting == 45 {
				close(all)
			}
			mu.Unlock()
			select {
			case <-all:
			case <-ctx.Done():
			}
		}
		return nr
	}
	r, err := fleet.NewRollout(fleet.RolloutConfig{ID: req.ID, Kind: events.RolloutGC, Nodes: nodes, GC: &req}, b, act)
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Run(ctx)
	if err != nil || res.Succeeded != n {
		t.Fatalf("rollout: %d of %d succeeded, %v (%+v)", res.Succeeded, n, err, res.Failed)
	}
	kinds, claims, outcomes := rolloutRecords(t, b, req.ID)
	// Ranges of at most 64 from each batch's first node: 1+1+1+1+1+1+1 for the batches up to 64, 2 for 128, 1
	// for the last 45.
	if kinds[events.RolloutClaimsKind] != 10 || kinds[events.RolloutClaimKind] != 0 || kinds[events.RolloutNodeKind] != 0 {
		t.Errorf("records by kind %v; want 10 claims records and no record per node", kinds)
	}
	// The last batch's 45 outcomes end together: while the first record is written the others wait for the
	// next. Allowing for a few written before all arrived, at least 20 share a record.
	if g := kinds[events.RolloutNodesKind]; g > n-20 || g < 1 {
		t.Errorf("%d outcome records for %d nodes; the last batch's 45 outcomes, ended together, should share records", g, n)
	}
	for _, node := range nodes {
		if claims[node] != 1 || outcomes[node] != 1 {
			t.Errorf("node %s: %d claims, %d outcomes; want one of each", node, claims[node], outcomes[node])
		}
	}
	if len(claims) != n || len(outcomes) != n {
		t.Errorf("claims name %d nodes, outcomes %d; want %d", len(claims), len(outcomes), n)
	}
	started, cl, rs, err := fleet.LoadRollout(t.Context(), b, req.ID)
	if err != nil || started == nil || started.ClaimSize != 64 || len(cl) != n || len(rs) != n {
		t.Fatalf("LoadRollout: plan %+v, %d claims, %d outcomes, %v", started, len(cl), len(rs), err)
	}
	followed := map[string]int{}
	fctx, fcancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer fcancel()
	if err := fleet.FollowRollout(fctx, b, req.ID, func(ev fleet.RolloutEvent) bool {
		if ev.Claim != nil {
			followed["claim "+ev.Claim.Node]++
		}
		if ev.Node != nil {
			followed["node "+ev.Node.Node]++
		}
		return ev.Finished == nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(followed) != 2*n {
		t.Errorf("FollowRollout gave %d claim and node events, want %d", len(followed), 2*n)
	}
	again := gcRollout(t, b, fleet.RolloutConfig{ID: req.ID, Nodes: nodes}, req)
	passes := s.passesOf()
	for _, node := range nodes {
		if passes[node] != 1 {
			t.Errorf("node %s: %d passes, want 1", node, passes[node])
		}
	}
	if again.Succeeded != n {
		t.Errorf("rerun: %d of %d succeeded", again.Succeeded, n)
	}
}

// TestRolloutOfAnEarlierReleaseKeepsARecordPerNode: a rollout whose plan has no claim size (recorded by an
// earlier release) is claimed and recorded a node at a time when this release resumes it, so that an
// earlier release's run of it still sees every claim.
func TestRolloutOfAnEarlierReleaseKeepsARecordPerNode(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s := newScriptedGC(1)
	s.serve(t, ctx, bustest.Connect(t, srv))
	id := "gc-per-node-1"
	nodes := []string{"node-0", "node-1", "node-2", "node-3"}
	if err := fleet.EnsureRolloutStream(t.Context(), b, 0); err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(map[string]any{"id": id, "kind": "gc", "initialBatch": 1, "nodeTimeout": "1m0s",
		"gc": map[string]any{"allUnused": true}, "nodes": nodes, "time": time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.PublishStored(t.Context(), bus.RawMsg{Subject: events.RolloutSubject(id, events.RolloutStartedKind, ""), MsgID: id + ".started", Data: raw}); err != nil {
		t.Fatal(err)
	}
	res := gcRollout(t, b, fleet.RolloutConfig{ID: id, Nodes: nodes}, events.GCRequest{ID: id, AllUnused: true})
	if res.Succeeded != len(nodes) {
		t.Fatalf("%d of %d succeeded: %+v", res.Succeeded, len(nodes), res.Failed)
	}
	kinds, claims, outcomes := rolloutRecords(t, b, id)
	if kinds[events.RolloutClaimKind] != len(nodes) || kinds[events.RolloutNodeKind] != len(nodes) ||
		kinds[events.RolloutClaimsKind] != 0 || kinds[events.RolloutNodesKind] != 0 {
		t.Errorf("records by kind %v; want a claim and an outcome record per node", kinds)
	}
	for _, node := range nodes {
		if claims[node] != 1 || outcomes[node] != 1 {
			t.Errorf("node %s: %d claims, %d outcomes", node, claims[node], outcomes[node])
		}
	}
}

// TestRolloutThatEndsActsOnNoMoreNodesOfItsRange: a run whose context ends acts on no node after, even on a
// node whose range this run has claimed (a range wider than the in-flight cap: the plan's claim size, kept
// by a resumed run with a smaller cap).
func TestRolloutThatEndsActsOnNoMoreNodesOfItsRange(t *testing.T) {
	_, b := bustest.Start(t)
	id := "gc-ended-range"
	var nodes []string
	for i := range 15 { // batches 1, 2, 4 and 8: the last is one range of 8 (nodes 7-14) at a claim size of 8
		nodes = append(nodes, fmt.Sprintf("node-%02d", i))
	}
	budget := fleet.FailureBudget{N: 15}
	// The first run records the plan (claim size 8, its in-flight cap) and ends while acting on node-00.
	ctx1, cancel1 := context.WithCancel(t.Context())
	r1, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: nodes, MaxInFlight: 8, FailureBudget: budget}, b,
		func(context.Context, string) events.RolloutNodeResult {
			cancel1()
			return events.RolloutNodeResult{OK: true}
		})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r1.Run(ctx1); err == nil {
		t.Fatal("the ended run returned no error")
	}
	// The second resumes it one node at a time and ends while acting on node-07, the first of the last range.
	var mu sync.Mutex
	acts := map[string]int{}
	ctx2, cancel2 := context.WithCancel(t.Context())
	defer cancel2()
	r2, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: nodes, MaxInFlight: 1}, b,
		func(_ context.Context, node string) events.RolloutNodeResult {
			mu.Lock()
			acts[node]++
			mu.Unlock()
			if node == "node-07" {
				cancel2()
			}
			return events.RolloutNodeResult{OK: true}
		})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Run(ctx2); err == nil {
		t.Fatal("the ended resumed run returned no error")
	}
	for i, node := range nodes {
		want := 0
		if i >= 1 && i <= 7 {
			want = 1
		}
		if acts[node] != want {
			t.Errorf("node %s acted on %d times, want %d", node, acts[node], want)
		}
	}
}
