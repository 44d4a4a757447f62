package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/fleettest"
)

const mib = 1 << 20

// startNodes starts n stand-in nodes named node-00.. with two unused images (10 and 20 MiB) and one in use
// (5 MiB) each; configure may change node i before it serves.
func startNodes(t *testing.T, b *bus.Bus, n int, configure func(i int, nd *fleettest.Node)) []*fleettest.Node {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	nodes := make([]*fleettest.Node, n)
	for i := range n {
		rt := critest.NewRuntime(
			cri.Image{ID: "sha256:a", RepoTags: []string{"docker.io/library/a:1"}, Size: 10 * mib},
			cri.Image{ID: "sha256:b", RepoTags: []string{"docker.io/library/b:1"}, Size: 20 * mib},
			cri.Image{ID: "sha256:c", RepoTags: []string{"docker.io/library/c:1"}, Size: 5 * mib},
		)
		rt.Use("sha256:c")
		nd := &fleettest.Node{Name: fmt.Sprintf("node-%02d", i), RT: rt, Bus: b}
		if configure != nil {
			configure(i, nd)
		}
		nodes[i] = nd
		wg.Add(2)
		go func() { defer wg.Done(); _ = nd.ServeGC(ctx) }()
		go func() { defer wg.Done(); _ = nd.ServePulls(ctx) }()
	}
	// A request sent before a node subscribes finds no responders and GCAction sends it again.
	return nodes
}

func names(nodes []*fleettest.Node) []string {
	out := make([]string, len(nodes))
	for i, n := range nodes {
		out[i] = n.Name
	}
	return out
}

func gcRollout(t *testing.T, b *bus.Bus, cfg fleet.RolloutConfig, req events.GCRequest) events.RolloutResult {
	t.Helper()
	cfg.Kind = events.RolloutGC
	cfg.DryRun = req.DryRun
	cfg.GC = &req
	r, err := fleet.NewRollout(cfg, b, fleet.GCAction(b, req))
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Run(t.Context())
	if err != nil {
		t.Fatalf("rollout: %v", err)
	}
	return res
}

func TestRolloutGCWaves(t *testing.T) {
	cases := []struct {
		name          string
		nodes         int
		initial       int
		failing       []int // node indexes whose GC reports a failure
		slow          []int // node indexes that answer after the node timeout
		wantBatches   []int
		wantSucceeded int
		wantFailed    []string
		wantCalled    int // nodes that received a GC request
	}{
		{name: "all succeed", nodes: 10, initial: 1, wantBatches: []int{1, 2, 4, 3}, wantSucceeded: 10, wantCalled: 10},
		{name: "first node fails", nodes: 10, initial: 1, failing: []int{0}, wantBatches: []int{1}, wantSucceeded: 0,
			wantFailed: []string{"node-00"}, wantCalled: 1},
		{name: "failure in the third batch stops there", nodes: 10, initial: 1, failing: []int{4, 6}, wantBatches: []int{1, 2, 4},
			wantSucceeded: 5, wantFailed: []string{"node-04", "node-06"}, wantCalled: 7},
		{name: "initial batch two", nodes: 7, initial: 2, wantBatches: []int{2, 4, 1}, wantSucceeded: 7, wantCalled: 7},
		{name: "a node past the timeout fails its batch", nodes: 5, initial: 1, slow: []int{2}, wantBatches: []int{1, 2},
			wantSucceeded: 2, wantFailed: []string{"node-02"}, wantCalled: 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, b := bustest.Start(t)
			nodes := startNodes(t, b, tc.nodes, func(i int, nd *fleettest.Node) {
				if slices.Contains(tc.failing, i) {
					nd.Fail = "Failed to garbage collect required amount of images. Attempted to free 100 bytes, but only found 0 bytes eligible to free."
				}
				if slices.Contains(tc.slow, i) {
					nd.Delay = 2 * time.Second
				}
			})
			res := gcRollout(t, b, fleet.RolloutConfig{Nodes: names(nodes), InitialBatch: tc.initial, NodeTimeout: 300 * time.Millisecond},
				events.GCRequest{AllUnused: true})
			if !slices.Equal(res.Batches, tc.wantBatches) {
				t.Errorf("batches = %v, want %v", res.Batches, tc.wantBatches)
			}
			if res.Succeeded != tc.wantSucceeded {
				t.Errorf("succeeded = %d, want %d", res.Succeeded, tc.wantSucceeded)
			}
			var failed []string
			for _, f := range res.Failed {
				failed = append(failed, f.Node)
				if f.Error == "" {
					t.Errorf("failed node %s without an error", f.Node)
				}
			}
			if !slices.Equal(failed, tc.wantFailed) {
				t.Errorf("failed = %v, want %v", failed, tc.wantFailed)
			}
			called := 0
			for _, nd := range nodes {
				called += int(nd.GCCalls())
				if nd.GCCalls() > 1 {
					t.Errorf("node %s acted on %d times", nd.Name, nd.GCCalls())
				}
			}
			if called != tc.wantCalled {
				t.Errorf("nodes called = %d, want %d", called, tc.wantCalled)
			}
			total := 0
			for _, s := range res.Batches {
				total += s
			}
			if res.NotStarted != tc.nodes-total {
				t.Errorf("notStarted = %d, want %d", res.NotStarted, tc.nodes-total)
			}
			for _, i := range tc.slow {
				for _, f := range res.Failed {
					if f.Node == nodes[i].Name && !strings.Contains(f.Error, "no answer within the node timeout 300ms") {
						t.Errorf("slow node error = %q", f.Error)
					}
				}
			}
		})
	}
}

func TestRolloutDryRunTotalsAndRemovesNothing(t *testing.T) {
	_, b := bustest.Start(t)
	nodes := startNodes(t, b, 4, nil)
	res := gcRollout(t, b, fleet.RolloutConfig{Nodes: names(nodes)}, events.GCRequest{DryRun: true, AllUnused: true})
	if !res.DryRun || res.Succeeded != 4 {
		t.Fatalf("dry run result: %+v", res)
	}
	// Each node would free its two unused images (10 + 20 MiB); the in-use one stays.
	if want := int64(4 * 30 * mib); res.FreedBytes != want {
		t.Errorf("fleet total = %d, want %d", res.FreedBytes, want)
	}
	for _, nr := range res.Nodes {
		if nr.GC == nil || len(nr.GC.Removed) != 2 || !nr.GC.DryRun {
			t.Errorf("node %s: %+v", nr.Node, nr.GC)
		}
	}
	for _, nd := range nodes {
		if n := len(nd.RT.(*critest.Runtime).Images()); n != 3 {
			t.Errorf("dry run removed images on %s: %d left", nd.Name, n)
		}
		if nd.DryRuns() != 1 {
			t.Errorf("node %s got %d dry runs", nd.Name, nd.DryRuns())
		}
	}
	// The real run frees the same bytes.
	res = gcRollout(t, b, fleet.RolloutConfig{Nodes: names(nodes)}, events.GCRequest{AllUnused: true})
	if want := int64(4 * 30 * mib); res.FreedBytes != want || res.Succeeded != 4 {
		t.Errorf("real run: freed %d, succeeded %d", res.FreedBytes, res.Succeeded)
	}
	for _, nd := range nodes {
		if n := len(nd.RT.(*critest.Runtime).Images()); n != 1 {
			t.Errorf("real run on %s left %d images, want 1", nd.Name, n)
		}
	}
}

func TestRolloutRecordedStreamAndResume(t *testing.T) {
	_, b := bustest.Start(t)
	nodes := startNodes(t, b, 5, nil)
	id := "gc-resume-1"
	res := gcRollout(t, b, fleet.RolloutConfig{ID: id, Nodes: names(nodes), Selector: "zone=a"}, events.GCRequest{AllUnused: true})
	if res.Succeeded != 5 {
		t.Fatalf("first run: %+v", res)
	}
	// Everything was recorded: the plan, a claim and an outcome per node, the batches, the result.
	kinds := map[string]int{}
	var finished *events.RolloutResult
	fctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err := fleet.FollowRollout(fctx, b, id, func(ev fleet.RolloutEvent) bool {
		kinds[ev.Kind]++
		if ev.Finished != nil {
			finished = ev.Finished
			return false
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"started": 1, "claim": 5, "node": 5, "batch": 3, "finished": 1}
	for k, n := range want {
		if kinds[k] != n {
			t.Errorf("%d %s records, want %d (all: %v)", kinds[k], k, n, kinds)
		}
	}
	if finished == nil || finished.Succeeded != 5 || !slices.Equal(finished.Batches, []int{1, 2, 2}) {
		t.Errorf("finished record: %+v", finished)
	}
	// Running the same rollout again acts on no node: every outcome is carried over.
	res = gcRollout(t, b, fleet.RolloutConfig{ID: id, Nodes: names(nodes)}, events.GCRequest{AllUnused: true})
	if res.Succeeded != 5 {
		t.Errorf("resumed run: %+v", res)
	}
	for _, nr := range res.Nodes {
		if !nr.Resumed {
			t.Errorf("node %s not marked resumed", nr.Node)
		}
	}
	for _, nd := range nodes {
		if nd.GCCalls() != 1 {
			t.Errorf("node %s acted on %d times", nd.Name, nd.GCCalls())
		}
	}
}

func TestRolloutResumeAfterCrashActsAtMostOnce(t *testing.T) {
	_, b := bustest.Start(t)
	release := make(chan struct{})
	nodes := startNodes(t, b, 7, nil)
	id := "gc-crash-1"
	var once sync.Once
	ctx, cancel := context.WithCancel(t.Context())
	// The orchestrator "crashes" (its context ends) while node-03 of the third batch is being acted on.
	act := func(actx context.Context, node string) events.RolloutNodeResult {
		if node == "node-03" {
			once.Do(cancel)
			<-actx.Done()
			close(release)
			return events.RolloutNodeResult{Node: node, Error: actx.Err().Error()}
		}
		return fleet.GCAction(b, events.GCRequest{AllUnused: true})(actx, node)
	}
	r, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: names(nodes)}, b, act)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Run(ctx); err == nil {
		t.Fatal("crashed rollout returned no error")
	}
	<-release
	// A second orchestrator resumes: nodes 0-2 keep their outcomes. Of the third batch (nodes 3-6, acted on
	// at once), node-03 and any other node claimed without a recorded outcome when the first orchestrator
	// stopped is not acted on again: it fails. Nodes 4-6 race the crash: each may have finished first (its
	// outcome is resumed) or not been claimed yet (the second orchestrator acts on it); either way once.
	res := gcRollout(t, b, fleet.RolloutConfig{ID: id, Nodes: names(nodes)}, events.GCRequest{AllUnused: true})
	if !slices.Equal(res.Batches, []int{1, 2, 4}) {
		t.Errorf("batches = %v", res.Batches)
	}
	if len(res.Failed)+res.Succeeded != 7 || res.Succeeded < 3 || len(res.Failed) < 1 {
		t.Errorf("succeeded %d, failed = %+v", res.Succeeded, res.Failed)
	}
	failed := map[string]bool{}
	for _, f := range res.Failed {
		failed[f.Node] = true
		if !strings.Contains(f.Error, "without a recorded outcome; not acted on again") {
			t.Errorf("failed %s: %q", f.Node, f.Error)
		}
	}
	if !failed["node-03"] {
		t.Errorf("node-03, claimed when the orchestrator crashed, is not among the failed: %+v", res.Failed)
	}
	for _, nd := range nodes {
		// A node that succeeded was acted on exactly once, by one of the two orchestrators.
		if !failed[nd.Name] && nd.GCCalls() != 1 {
			t.Errorf("node %s succeeded but was acted on %d times", nd.Name, nd.GCCalls())
		}
	}
	for _, nd := range nodes {
		if nd.GCCalls() > 1 {
			t.Errorf("node %s acted on %d times", nd.Name, nd.GCCalls())
		}
	}
	if nodes[3].GCCalls() != 0 {
		t.Errorf("node-03 acted on after its claim")
	}
}

func TestTwoOrchestratorsActOnEachNodeOnce(t *testing.T) {
	_, b := bustest.Start(t)
	nodes := startNodes(t, b, 15, nil)
	id := "gc-race-1"
	var wg sync.WaitGroup
	results := make([]events.RolloutResult, 2)
	for k := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := events.GCRequest{AllUnused: true}
			r, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: names(nodes), GC: &req}, b, fleet.GCAction(b, req))
			if err != nil {
				t.Error(err)
				return
			}
			res, err := r.Run(t.Context())
			if err != nil {
				t.Error(err)
			}
			results[k] = res
		}()
	}
	wg.Wait()
	total := int64(0)
	for _, nd := range nodes {
		total += nd.GCCalls()
		if nd.GCCalls() > 1 {
			t.Errorf("node %s acted on %d times", nd.Name, nd.GCCalls())
		}
	}
	// The claims decide: every node was acted on by exactly one orchestrator, unless the loser of a claim
	// stopped the other's progress by failing its batch first; never twice.
	if total == 0 {
		t.Fatal("no node was acted on")
	}
	t.Logf("nodes acted on: %d of 15; results: %d/%d succeeded", total, results[0].Succeeded, results[1].Succeeded)
}

func TestRolloutConfigValidation(t *testing.T) {
	_, b := bustest.Start(t)
	act := func(context.Context, string) events.RolloutNodeResult { return events.RolloutNodeResult{OK: true} }
	cases := []struct {
		name    string
		cfg     fleet.RolloutConfig
		wantErr string
	}{
		{"bad kind", fleet.RolloutConfig{Kind: "rm"}, `rollout kind "rm" must be gc or pull`},
		{"negative batch", fleet.RolloutConfig{Kind: "gc", InitialBatch: -1}, "initial batch -1 must be at least 1"},
		{"negative timeout", fleet.RolloutConfig{Kind: "gc", NodeTimeout: -time.Second}, "node timeout -1s must not be negative"},
		{"bad id", fleet.RolloutConfig{Kind: "gc", ID: "A.B"}, `rollout id "A.B" may hold only lower-case letters, digits and '-'`},
		{"duplicate node", fleet.RolloutConfig{Kind: "gc", Nodes: []string{"n1", "n1"}}, "node n1 is listed twice"},
		{"bad node", fleet.RolloutConfig{Kind: "gc", Nodes: []string{"N_1"}}, "not a DNS-1123 subdomain"},
		{"pull without image", fleet.RolloutConfig{Kind: "pull"}, "a pull rollout needs an image"},
		{"negative max failures", fleet.RolloutConfig{Kind: "gc", FailureBudget: fleet.FailureBudget{N: -1}}, "max failures -1 must not be negative"},
		{"max failures over 100%", fleet.RolloutConfig{Kind: "gc", FailureBudget: fleet.FailureBudget{N: 101, Percent: true}}, "max failures 101% must be at most 100%"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := fleet.NewRollout(tc.cfg, b, act)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want %q", err, tc.wantErr)
			}
		})
	}
}

func TestRolloutPull(t *testing.T) {
	_, b := bustest.Start(t)
	nodes := startNodes(t, b, 3, func(i int, nd *fleettest.Node) {
		if i == 2 {
			nd.RT.(*critest.Runtime).FailPull(fmt.Errorf("pull: %w", cri.ErrUnavailable))
		}
	})
	id := "pull-1"
	w, err := fleet.StartPullWatch(t.Context(), b, id, "docker.io/library/x:1", events.PullIfNotPresent)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	r, err := fleet.NewRollout(fleet.RolloutConfig{ID: id, Kind: events.RolloutPull, Image: "docker.io/library/x:1", Nodes: names(nodes), NodeTimeout: 10 * time.Second}, b, w.Action())
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Run(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if res.Succeeded != 2 || len(res.Failed) != 1 || res.Failed[0].Node != "node-02" || !strings.HasPrefix(res.Failed[0].Error, "ErrImagePull") {
		raw, _ := json.Marshal(res)
		t.Fatalf("pull rollout: %s", raw)
	}
	for _, nr := range res.Nodes[:2] {
		if nr.Pull == nil || nr.Pull.ImageRef != "sha256:pulled-docker.io/library/x:1" {
			t.Errorf("node %s pull outcome %+v", nr.Node, nr.Pull)
		}
	}
	for i, nd := range nodes {
		if nd.Pulls() != 1 {
			t.Errorf("node %d pulled %d times", i, nd.Pulls())
		}
	}
}
