package fleet_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestRolloutStreamsResults: with a Results sink, each node's outcome goes to the sink once, one call at a
// time, the result keeps no node (only counts, sums and MaxFailures failures, in plan order), at most
// MaxInFlight nodes are acted on at once, and the batches are those of slow start.
func TestRolloutStreamsResults(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s := newScriptedGC(3)
	// Three nodes of the last batch (31..39) fail: the rollout ends there anyway.
	failing := map[string]bool{"node-033": true, "node-035": true, "node-038": true}
	s.fail = func(n string) bool { return failing[n] }
	s.serve(t, ctx, bustest.Connect(t, srv))
	var nodes []string
	for i := range 40 {
		nodes = append(nodes, fmt.Sprintf("node-%03d", i))
	}
	var (
		mu              sync.Mutex
		got             = map[string]int{}
		inSink, maxSink atomic.Int64
		running, peak   atomic.Int64
	)
	req := events.GCRequest{ID: "gc-stream-1", AllUnused: true}
	gc := fleet.GCAction(b, req)
	// The second batch's two nodes wait for each other before they are acted on, so that two are acted on
	// at once however the goroutines are scheduled; a rollout that acted on them one at a time would keep
	// the first waiting in vain, and the peak below would say so.
	met := make(chan struct{})
	var meet sync.Once
	act := func(ctx context.Context, node string) events.RolloutNodeResult {
		n := running.Add(1)
		defer running.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		if n >= 2 {
			meet.Do(func() { close(met) })
		}
		if node == nodes[1] || node == nodes[2] {
			select {
			case <-met:
			case <-ctx.Done():
			case <-time.After(bustest.Timeout):
			}
		}
		return gc(ctx, node)
	}
	cfg := fleet.RolloutConfig{ID: req.ID, Kind: events.RolloutGC, Nodes: nodes, GC: &req, MaxInFlight: 4, MaxFailures: 2,
		Results: func(nr events.RolloutNodeResult) {
			if n := inSink.Add(1); n > maxSink.Load() {
				maxSink.Store(n)
			}
			mu.Lock()
			got[nr.Node]++
			mu.Unlock()
			inSink.Add(-1)
		}}
	r, err := fleet.NewRollout(cfg, b, act)
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Run(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Nodes) != 0 {
		t.Errorf("result holds %d nodes, want none (they went to the sink)", len(res.Nodes))
	}
	if res.Succeeded != 37 || res.FailedCount != 3 || res.FailedTotal() != 3 || res.NotStarted != 0 ||
		!slices.Equal(res.Batches, []int{1, 2, 4, 8, 16, 9}) {
		t.Errorf("result: succeeded %d, failed %d, not started %d, batches %v", res.Succeeded, res.FailedCount, res.NotStarted, res.Batches)
	}
	// The first two failures to arrive are kept, in plan order.
	if len(res.Failed) != 2 || !failing[res.Failed[0].Node] || !failing[res.Failed[1].Node] || res.Failed[0].Node >= res.Failed[1].Node {
		t.Errorf("failed %+v, want two of the failing nodes in plan order", res.Failed)
	}
	if want := int64(37 * 3 * (10 << 20)); res.FreedBytes != want {
		t.Errorf("freed %d, want %d", res.FreedBytes, want)
	}
	if len(got) != 40 || maxSink.Load() != 1 {
		t.Errorf("sink got %d nodes, at most %d calls at once; want 40, 1", len(got), maxSink.Load())
	}
	for n, c := range got {
		if c != 1 {
			t.Errorf("sink got %s %d times", n, c)
		}
	}
	if p := peak.Load(); p > 4 || p < 2 {
		t.Errorf("%d nodes acted on at once, want at most the cap 4 (and more than 1)", p)
	}

	// The outcome records of a real GC carry counts and bytes, not the lists of images.
	started, _, results, err := fleet.LoadRollout(t.Context(), b, req.ID)
	if err != nil {
		t.Fatal(err)
	}
	// LoadRolloutStarted reads the same plan alone, and nothing for a rollout that never started.
	if only, err := fleet.LoadRolloutStarted(t.Context(), b, req.ID); err != nil || only == nil || started == nil ||
		!slices.Equal(only.Nodes, started.Nodes) || len(only.Nodes) != len(nodes) || only.InitialBatch != started.InitialBatch {
		t.Errorf("LoadRolloutStarted: %+v, %v; LoadRollout's start: %+v", only, err, started)
	}
	if none, err := fleet.LoadRolloutStarted(t.Context(), b, "never-started"); err != nil || none != nil {
		t.Errorf("LoadRolloutStarted of a rollout that never started: %+v, %v", none, err)
	}
	rec := results["node-000"]
	if rec.GC == nil || len(rec.GC.Removed) != 0 || rec.GCCounts == nil ||
		*rec.GCCounts != (events.GCCounts{Removed: 3, Bytes: 3 * (10 << 20)}) || rec.GC.FreedBytes != 3*(10<<20) {
		t.Errorf("outcome record of node-000: gc %+v, counts %+v", rec.GC, rec.GCCounts)
	}

	// A resumed run reads the compact records: same totals, no node acted on again.
	res2, err := fleet.NewRollout(fleet.RolloutConfig{ID: req.ID, Kind: events.RolloutGC, Nodes: nodes, GC: &req}, b, act)
	if err != nil {
		t.Fatal(err)
	}
	again, err := res2.Run(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if again.FreedBytes != res.FreedBytes || again.Succeeded != 37 || len(again.Nodes) != 40 || !again.Nodes[0].Resumed {
		t.Errorf("resumed: freed %d (want %d), succeeded %d, %d nodes", again.FreedBytes, res.FreedBytes, again.Succeeded, len(again.Nodes))
	}
	for n, p := range s.passesOf() {
		if p != 1 {
			t.Errorf("%s: %d GC passes", n, p)
		}
	}

	// A dry run's records keep the list of what would be removed.
	dry := events.GCRequest{ID: "gc-stream-dry", DryRun: true, AllUnused: true}
	rd, err := fleet.NewRollout(fleet.RolloutConfig{ID: dry.ID, Kind: events.RolloutGC, Nodes: nodes[:3], GC: &dry, DryRun: true}, b, fleet.GCAction(b, dry))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rd.Run(t.Context()); err != nil {
		t.Fatal(err)
	}
	_, _, results, err = fleet.LoadRollout(t.Context(), b, dry.ID)
	if err != nil {
		t.Fatal(err)
	}
	if rec := results["node-001"]; rec.GC == nil || len(rec.GC.Removed) != 3 || rec.GCCounts != nil ||
		rec.Counts() != (events.GCCounts{Removed: 3, Bytes: 3 * (10 << 20)}) {
		t.Errorf("dry-run record of node-001: gc %+v, counts %+v", rec.GC, rec.GCCounts)
	}
}
