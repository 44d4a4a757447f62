package fleet_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestRolloutStopsBeforeABatch: StopBefore ends a rollout at a batch's start with its reason, acting on no
// node of that batch or a later one, and the rollout is finished on the bus. A run that resumes it replays
// the batches whose nodes all ended without asking, and stops at the first batch with a node to act on.
func TestRolloutStopsBeforeABatch(t *testing.T) {
	_, b := bustest.Start(t)
	var nodes []string
	for i := range 15 { // batches 1, 2, 4 and 8
		nodes = append(nodes, fmt.Sprintf("node-%02d", i))
	}
	var mu sync.Mutex
	acts := map[string]int{}
	act := func(_ context.Context, node string) events.RolloutNodeResult {
		mu.Lock()
		acts[node]++
		mu.Unlock()
		return events.RolloutNodeResult{OK: true}
	}
	run := func(id string, cfg fleet.RolloutConfig) (events.RolloutResult, error) {
		t.Helper()
		cfg.ID, cfg.Kind, cfg.Nodes = id, events.RolloutGC, nodes
		r, err := fleet.NewRollout(cfg, b, act)
		if err != nil {
			t.Fatal(err)
		}
		return r.Run(t.Context())
	}
	wantActs := func(acted int) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		for i, n := range nodes {
			want := 0
			if i < acted {
				want = 1
			}
			if acts[n] != want {
				t.Errorf("node %s acted on %d times, want %d", n, acts[n], want)
			}
		}
	}

	t.Run("a fresh rollout stops at its third batch", func(t *testing.T) {
		clear(acts)
		var asked []int
		res, err := run("gc-stop-fresh", fleet.RolloutConfig{StopBefore: func(bt events.RolloutBatch) string {
			asked = append(asked, bt.Index)
			if bt.Index == 3 {
				return "WindowEnded"
			}
			return ""
		}})
		if err != nil {
			t.Fatal(err)
		}
		if res.StopReason != "WindowEnded" || res.Succeeded != 3 || !slices.Equal(res.Batches, []int{1, 2}) || !slices.Equal(asked, []int{1, 2, 3}) {
			t.Errorf("result: stop %q, %d succeeded, batches %v, asked at %v", res.StopReason, res.Succeeded, res.Batches, asked)
		}
		wantActs(3)
		if fin := finishedRecord(t, b, "gc-stop-fresh"); fin.StopReason != "WindowEnded" || fin.Succeeded != 3 {
			t.Errorf("finished record: stop %q, %d succeeded", fin.StopReason, fin.Succeeded)
		}
	})

	t.Run("a resumed rollout replays the ended batches and stops at the next", func(t *testing.T) {
		clear(acts)
		id := "gc-stop-resumed"
		// The first run ends (its context, as a controller that stops) at the third batch's start.
		ctx, cancel := context.WithCancel(t.Context())
		r1, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: nodes, Progress: func(p fleet.Progress) {
			if p.Batch != nil && p.Batch.Index == 3 {
				cancel()
			}
		}}, b, act)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r1.Run(ctx); err == nil {
			t.Fatal("the ended run returned no error")
		}
		wantActs(3)
		// The second asks to stop before every batch: batches 1 and 2 only replay their outcomes.
		var asked []int
		res, err := run(id, fleet.RolloutConfig{StopBefore: func(bt events.RolloutBatch) string {
			asked = append(asked, bt.Index)
			return "WindowEnded"
		}})
		if err != nil {
			t.Fatal(err)
		}
		if res.StopReason != "WindowEnded" || res.Succeeded != 3 || !slices.Equal(asked, []int{3}) {
			t.Errorf("result: stop %q, %d succeeded, asked at %v", res.StopReason, res.Succeeded, asked)
		}
		wantActs(3)
		if fin := finishedRecord(t, b, id); fin.StopReason != "WindowEnded" || fin.Succeeded != 3 {
			t.Errorf("finished record: stop %q, %d succeeded", fin.StopReason, fin.Succeeded)
		}
	})
}
