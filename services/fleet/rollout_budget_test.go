package fleet_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/fleettest"
)

func TestParseFailureBudget(t *testing.T) {
	valid := []struct {
		in   string
		want fleet.FailureBudget
		str  string
	}{
		{"0", fleet.FailureBudget{}, "0"},
		{"10", fleet.FailureBudget{N: 10}, "10"},
		{"5%", fleet.FailureBudget{N: 5, Percent: true}, "5%"},
		{"0%", fleet.FailureBudget{Percent: true}, "0%"},
		{"100%", fleet.FailureBudget{N: 100, Percent: true}, "100%"},
		{"20000", fleet.FailureBudget{N: 20000}, "20000"},
	}
	for _, tc := range valid {
		got, err := fleet.ParseFailureBudget(tc.in)
		if err != nil || got != tc.want || got.String() != tc.str {
			t.Errorf("ParseFailureBudget(%q) = %+v (%q), %v; want %+v (%q)", tc.in, got, got.String(), err, tc.want, tc.str)
		}
	}
	invalid := []struct{ in, wantErr string }{
		{"-1", `"-1" must not be negative`},
		{"-5%", `"-5%" must not be negative`},
		{"101%", `"101%" must be at most 100%`},
		{"150%", `"150%" must be at most 100%`},
		{"", `"" is not a count (10) or a whole percentage of the planned nodes (5%)`},
		{"abc", `"abc" is not a count (10) or a whole percentage of the planned nodes (5%)`},
		{"%", `"%" is not a count`},
		{"5.5%", `"5.5%" is not a count`},
		{"10%%", `"10%%" is not a count`},
		{" 5", `" 5" is not a count`},
		{"+5", `"+5" is not a count`},
		{"5 %", `"5 %" is not a count`},
		{"99999999999999999999", `is not a count`},
	}
	for _, tc := range invalid {
		_, err := fleet.ParseFailureBudget(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("ParseFailureBudget(%q) err = %v, want %q", tc.in, err, tc.wantErr)
		}
	}
}

// TestFailureBudgetAllowed: a percentage of the planned nodes is rounded down (as a Deployment's
// maxUnavailable): the budget never allows more than its share.
func TestFailureBudgetAllowed(t *testing.T) {
	cases := []struct {
		budget  string
		planned int
		want    int
	}{
		{"0", 10000, 0},
		{"10", 5, 10},
		{"5%", 30, 1},      // 1.5
		{"1%", 50, 0},      // 0.5
		{"1%", 10000, 100}, // exact
		{"33%", 10, 3},     // 3.3
		{"99%", 10, 9},     // 9.9
		{"100%", 7, 7},
		{"50%", 0, 0},
		{"1%", 10099, 100}, // 100.99
	}
	for _, tc := range cases {
		b, err := fleet.ParseFailureBudget(tc.budget)
		if err != nil {
			t.Fatal(err)
		}
		if got := b.Allowed(tc.planned); got != tc.want {
			t.Errorf("%s of %d planned allows %d, want %d", tc.budget, tc.planned, got, tc.want)
		}
	}
}

// TestRolloutFailureBudget: a GC rollout over stand-in nodes (a real nats-server) goes on past failed nodes
// while the failures so far are within the budget, stops after the batch that takes them over it, counts a
// node past its timeout as a failure, and says which in the result; the default budget is today's rule.
func TestRolloutFailureBudget(t *testing.T) {
	// 10 nodes in batches of 1 | 2 | 4 | 3: node-00 | node-01, node-02 | node-03 ... node-06 | node-07 ... node-09
	cases := []struct {
		name          string
		budget        string
		failing, slow []int
		maxInFlight   int
		streamed      bool // results to a Results sink instead of RolloutResult.Nodes
		wantBatches   []int
		wantSucceeded int
		wantFailed    []string
		wantAllowed   int
		wantReason    string
	}{
		{name: "default budget stops at the first failing batch", budget: "0", failing: []int{1},
			wantBatches: []int{1, 2}, wantSucceeded: 2, wantFailed: []string{"node-01"}, wantReason: events.RolloutMaxFailuresExceeded},
		{name: "within a count: every batch runs", budget: "2", failing: []int{1}, slow: []int{5},
			wantBatches: []int{1, 2, 4, 3}, wantSucceeded: 8, wantFailed: []string{"node-01", "node-05"}, wantAllowed: 2, wantReason: events.RolloutCompleted},
		{name: "over a count: stops after the batch that exceeds", budget: "1", failing: []int{1, 4}, slow: []int{6},
			wantBatches: []int{1, 2, 4}, wantSucceeded: 4, wantFailed: []string{"node-01", "node-04", "node-06"}, wantAllowed: 1, wantReason: events.RolloutMaxFailuresExceeded},
		{name: "a percentage of the planned nodes, rounded down", budget: "29%", failing: []int{0, 3}, maxInFlight: 1,
			wantBatches: []int{1, 2, 4, 3}, wantSucceeded: 8, wantFailed: []string{"node-00", "node-03"}, wantAllowed: 2, wantReason: events.RolloutCompleted},
		{name: "over a percentage, counted across batches", budget: "29%", failing: []int{0, 2, 8}, streamed: true,
			wantBatches: []int{1, 2, 4, 3}, wantSucceeded: 7, wantFailed: []string{"node-00", "node-02", "node-08"}, wantAllowed: 2, wantReason: events.RolloutMaxFailuresExceeded},
		{name: "100% never stops", budget: "100%", failing: []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9},
			wantBatches: []int{1, 2, 4, 3}, wantSucceeded: 0, wantFailed: []string{"node-00", "node-01", "node-02", "node-03", "node-04", "node-05", "node-06", "node-07", "node-08", "node-09"},
			wantAllowed: 10, wantReason: events.RolloutCompleted},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, b := bustest.Start(t)
			nodes := startNodes(t, b, 10, func(i int, nd *fleettest.Node) {
				if slices.Contains(tc.failing, i) {
					nd.Fail = "Failed to garbage collect required amount of images. Attempted to free 100 bytes, but only found 0 bytes eligible to free."
				}
				if slices.Contains(tc.slow, i) {
					nd.Delay = 2 * time.Second
				}
			})
			budget, err := fleet.ParseFailureBudget(tc.budget)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var streamed []string
			cfg := fleet.RolloutConfig{ID: "gc-budget", Nodes: names(nodes), NodeTimeout: 500 * time.Millisecond,
				FailureBudget: budget, MaxInFlight: tc.maxInFlight}
			if tc.streamed {
				cfg.Results = func(nr events.RolloutNodeResult) {
					mu.Lock()
					defer mu.Unlock()
					streamed = append(streamed, nr.Node)
				}
			}
			res := gcRollout(t, b, cfg, events.GCRequest{AllUnused: true})
			var failed []string
			for _, f := range res.Failed {
				failed = append(failed, f.Node)
			}
			ran := 0
			for _, s := range tc.wantBatches {
				ran += s
			}
			if !slices.Equal(res.Batches, tc.wantBatches) || res.Succeeded != tc.wantSucceeded || !slices.Equal(failed, tc.wantFailed) ||
				res.FailedCount != len(tc.wantFailed) || res.NotStarted != 10-ran {
				t.Errorf("batches %v, %d succeeded, failed %v (%d), %d not started; want %v, %d, %v, %d",
					res.Batches, res.Succeeded, failed, res.FailedCount, res.NotStarted, tc.wantBatches, tc.wantSucceeded, tc.wantFailed, 10-ran)
			}
			if res.MaxFailures != budget.String() || res.FailureBudget != tc.wantAllowed || res.StopReason != tc.wantReason {
				t.Errorf("maxFailures %q, failureBudget %d, stopReason %q; want %q, %d, %q", res.MaxFailures, res.FailureBudget,
					res.StopReason, budget.String(), tc.wantAllowed, tc.wantReason)
			}
			for _, i := range tc.slow {
				for _, f := range res.Failed {
					if f.Node == nodes[i].Name && !strings.Contains(f.Error, "no answer within the node timeout 500ms") {
						t.Errorf("slow node %s: %q", f.Node, f.Error)
					}
				}
			}
			for i, nd := range nodes {
				want := int64(0)
				if i < ran {
					want = 1
				}
				if nd.GCCalls() != want {
					t.Errorf("node %s acted on %d times, want %d", nd.Name, nd.GCCalls(), want)
				}
			}
			if tc.streamed && len(streamed) != ran {
				t.Errorf("%d results streamed, want %d", len(streamed), ran)
			}
			// The summary record says the same.
			fin := finishedRecord(t, b, cfg.ID)
			if fin.StopReason != tc.wantReason || fin.FailureBudget != tc.wantAllowed || fin.FailedCount != len(tc.wantFailed) {
				t.Errorf("finished record: %+v", fin)
			}
		})
	}
}

// TestRolloutResumeKeepsFailureBudget: the budget is in the plan record; an orchestrator that resumes the
// rollout (same id) after a crash, given no budget, keeps the recorded one and goes on past the failures the
// budget allows, acting on no node twice.
func TestRolloutResumeKeepsFailureBudget(t *testing.T) {
	_, b := bustest.Start(t)
	nodes := startNodes(t, b, 10, func(i int, nd *fleettest.Node) {
		if i == 1 {
			nd.Fail = "Failed to garbage collect required amount of images. Attempted to free 100 bytes, but only found 0 bytes eligible to free."
		}
	})
	id := "gc-budget-resume"
	ctx, cancel := context.WithCancel(t.Context())
	// The first orchestrator crashes (its context ends) while it acts on node-03, the first node of the third
	// batch; one node at a time, so nodes 4-6 are never claimed.
	release := make(chan struct{})
	var once sync.Once
	req := events.GCRequest{AllUnused: true}
	act := func(actx context.Context, node string) events.RolloutNodeResult {
		if node == "node-03" {
			once.Do(cancel)
			<-actx.Done()
			close(release)
			return events.RolloutNodeResult{Node: node, Error: actx.Err().Error()}
		}
		return fleet.GCAction(b, req)(actx, node)
	}
	r, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: names(nodes), GC: &req,
		FailureBudget: fleet.FailureBudget{N: 2}, MaxInFlight: 1}, b, act)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Run(ctx); err == nil {
		t.Fatal("crashed rollout returned no error")
	}
	<-release
	started, _, _, err := fleet.LoadRollout(t.Context(), b, id)
	if err != nil {
		t.Fatal(err)
	}
	if started == nil || started.MaxFailures != "2" {
		t.Fatalf("plan record: %+v", started)
	}
	// Resumed without a budget: node-01's failure (recorded) and node-03's (claimed without an outcome) are
	// within the recorded budget of 2, so every batch runs; without it, the rollout would stop after batch 2.
	res := gcRollout(t, b, fleet.RolloutConfig{ID: id, Nodes: names(nodes)}, req)
	var failed []string
	for _, f := range res.Failed {
		failed = append(failed, f.Node)
	}
	if !slices.Equal(res.Batches, []int{1, 2, 4, 3}) || res.Succeeded != 8 || !slices.Equal(failed, []string{"node-01", "node-03"}) ||
		res.MaxFailures != "2" || res.FailureBudget != 2 || res.StopReason != events.RolloutCompleted {
		t.Errorf("resumed: batches %v, %d succeeded, failed %v, maxFailures %q (%d), stopReason %q", res.Batches, res.Succeeded,
			failed, res.MaxFailures, res.FailureBudget, res.StopReason)
	}
	for i, nd := range nodes {
		want := int64(1)
		if i == 3 { // claimed when the first orchestrator crashed: not acted on again
			want = 0
		}
		if nd.GCCalls() != want {
			t.Errorf("node %s acted on %d times, want %d", nd.Name, nd.GCCalls(), want)
		}
	}
	// A plan without the field (written by the previous release) resumes with no budget, whatever this run
	// asks: it stops after the batch with node-01's failure.
	old := "gc-budget-old-plan"
	if err := fleet.EnsureRolloutStream(t.Context(), b, 0); err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(map[string]any{"id": old, "kind": "gc", "initialBatch": 1, "nodeTimeout": "1m0s", "dryRun": true,
		"gc": map[string]any{"dryRun": true, "allUnused": true}, "nodes": names(nodes)[:4], "time": time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.PublishStored(t.Context(), bus.RawMsg{Subject: events.RolloutSubject(old, events.RolloutStartedKind, ""), MsgID: old + ".started", Data: raw}); err != nil {
		t.Fatal(err)
	}
	res = gcRollout(t, b, fleet.RolloutConfig{ID: old, Nodes: names(nodes)[:4], FailureBudget: fleet.FailureBudget{N: 5}},
		events.GCRequest{DryRun: true, AllUnused: true})
	if res.MaxFailures != "0" || res.FailureBudget != 0 || res.StopReason != events.RolloutMaxFailuresExceeded || !slices.Equal(res.Batches, []int{1, 2}) {
		t.Errorf("previous release's plan: %+v", res)
	}
}

// finishedRecord reads rollout id's finished record.
func finishedRecord(t *testing.T, b *bus.Bus, id string) events.RolloutResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var fin *events.RolloutResult
	err := fleet.FollowRollout(ctx, b, id, func(ev fleet.RolloutEvent) bool {
		fin = ev.Finished
		return fin == nil
	})
	if err != nil || fin == nil {
		t.Fatalf("finished record of %s: %v", id, err)
	}
	return *fin
}
