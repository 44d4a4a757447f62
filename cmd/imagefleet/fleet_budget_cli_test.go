package main_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestFleetGCMaxFailures drives `fleet gc --max-failures` of the built binary against a real nats-server
// and scripted GC answers that fail on n2 and n5 (10 nodes: batches n1 | n2 n3 | n4 ... n7 | n8 n9 n10): invalid budgets
// are refused before any node is acted on; a budget the failures stay within runs every batch, a smaller one
// stops after the batch that exceeds it; both exit 2 and say which; a resumed rollout keeps its budget and
// `fleet follow` shows it.
func TestFleetGCMaxFailures(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	var mu sync.Mutex
	passes := map[string]int{} // by rollout id and node
	failing := []string{"n2", "n5"}
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = b.ServeConcurrent(ctx, events.Prefix+".cmd.*."+events.VerbGC, "budget-gc", 16, func(_ context.Context, data []byte) (any, error) {
				var req events.GCRequest
				if err := events.DecodeStrict(data, &req); err != nil {
					return nil, err
				}
				id, node, _ := strings.Cut(req.ID, ".")
				mu.Lock()
				passes[id+"/"+node]++
				mu.Unlock()
				res := events.GCResult{Node: node, DryRun: req.DryRun}
				if slices.Contains(failing, node) {
					res.Error = "Failed to garbage collect required amount of images. Attempted to free 100 bytes, but only found 0 bytes eligible to free."
				}
				return res, nil
			})
		}()
	}
	bustest.Eventually(t, "the scripted GC answers", pollTimeout, func() error {
		var res events.GCResult
		return b.Request(t.Context(), events.CommandSubject("probe", events.VerbGC), events.GCRequest{ID: "probe.probe", DryRun: true}, &res)
	})
	common := []string{"--nats", srv.ClientURL(), "--nodes", "n1,n2,n3,n4,n5,n6,n7,n8,n9,n10", "--node-timeout", "10s"}
	acted := func(id string) []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for k, n := range passes {
			if rest, ok := strings.CutPrefix(k, id+"/"); ok {
				out = append(out, rest)
				if n != 1 {
					t.Errorf("%s acted on %d times", k, n)
				}
			}
		}
		slices.Sort(out)
		return out
	}

	for _, bad := range []struct{ value, want string }{
		{"-1", `--max-failures: "-1" must not be negative`},
		{"101%", `--max-failures: "101%" must be at most 100%`},
		{"lots", `--max-failures: "lots" is not a count (10) or a whole percentage of the planned nodes (5%)`},
		{"2.5%", `--max-failures: "2.5%" is not a count`},
	} {
		_, errOut, code := run(t, append([]string{"fleet", "gc", "--id", "gc-bad-budget", "--max-failures", bad.value}, common...)...)
		if code != 1 || !strings.Contains(errOut, bad.want) {
			t.Errorf("--max-failures %s: exit %d, stderr %q; want exit 1 and %q", bad.value, code, errOut, bad.want)
		}
	}
	// fleet pull takes the same flag, refused the same way before any request is queued.
	if _, errOut, code := run(t, append([]string{"fleet", "pull", "registry.example/app:v1", "--id", "pull-bad-budget", "--max-failures", "-3%"}, common...)...); code != 1 ||
		!strings.Contains(errOut, `--max-failures: "-3%" must not be negative`) {
		t.Errorf("fleet pull --max-failures -3%%: exit %d, stderr %q", code, errOut)
	}
	if got := acted("gc-bad-budget"); len(got) != 0 {
		t.Errorf("an invalid budget acted on %v", got)
	}

	jsonRun := func(id string, extra ...string) (events.RolloutResult, string, int) {
		t.Helper()
		out, errOut, code := run(t, append(append([]string{"fleet", "gc", "--dry-run", "--id", id, "-o", "json"}, common...), extra...)...)
		var res events.RolloutResult
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("%s: output is not one JSON document: %v\n%s\n%s", id, err, out, errOut)
		}
		return res, errOut, code
	}
	cases := []struct {
		id, budget    string
		wantBatches   []int
		wantSucceeded int
		wantAllowed   int
		wantReason    string
		wantErr       string
	}{
		{"gc-budget-default", "", []int{1, 2}, 2, 0, events.RolloutMaxFailuresExceeded,
			"rollout gc-budget-default: 1 of 10 nodes failed, 7 not started; max failures 0 (0 nodes) exceeded: stopped after batch 2 (MaxFailuresExceeded)"},
		{"gc-budget-within", "2", []int{1, 2, 4, 3}, 8, 2, events.RolloutCompleted,
			"rollout gc-budget-within: 2 of 10 nodes failed, 0 not started; max failures 2 (2 nodes): within it, every batch ran (Completed)"},
		{"gc-budget-percent", "29%", []int{1, 2, 4, 3}, 8, 2, events.RolloutCompleted, "max failures 29% (2 nodes): within it"},
		{"gc-budget-over", "1", []int{1, 2, 4}, 5, 1, events.RolloutMaxFailuresExceeded,
			"rollout gc-budget-over: 2 of 10 nodes failed, 3 not started; max failures 1 (1 node) exceeded: stopped after batch 3 (MaxFailuresExceeded)"},
		{"gc-budget-over-percent", "19%", []int{1, 2, 4}, 5, 1, events.RolloutMaxFailuresExceeded, "max failures 19% (1 node) exceeded: stopped after batch 3"},
		{"gc-budget-rounded-to-0", "9%", []int{1, 2}, 2, 0, events.RolloutMaxFailuresExceeded, "max failures 9% (0 nodes) exceeded: stopped after batch 2"},
	}
	for _, tc := range cases {
		var extra []string
		if tc.budget != "" {
			extra = []string{"--max-failures", tc.budget}
		}
		res, errOut, code := jsonRun(tc.id, extra...)
		ran := 0
		for _, s := range tc.wantBatches {
			ran += s
		}
		wantMax := tc.budget
		if wantMax == "" {
			wantMax = "0"
		}
		if code != 2 || !strings.Contains(errOut, tc.wantErr) {
			t.Errorf("%s: exit %d, stderr %q; want exit 2 and %q", tc.id, code, errOut, tc.wantErr)
		}
		if !slices.Equal(res.Batches, tc.wantBatches) || res.Succeeded != tc.wantSucceeded || res.FailedCount != ran-tc.wantSucceeded ||
			res.NotStarted != 10-ran || res.MaxFailures != wantMax || res.FailureBudget != tc.wantAllowed || res.StopReason != tc.wantReason {
			t.Errorf("%s: batches %v, %d succeeded, %d failed, %d not started, maxFailures %q (%d), stopReason %q", tc.id, res.Batches,
				res.Succeeded, res.FailedCount, res.NotStarted, res.MaxFailures, res.FailureBudget, res.StopReason)
		}
		if got := acted(tc.id); len(got) != ran {
			t.Errorf("%s: acted on %v, want the first %d", tc.id, got, ran)
		}
	}

	// The text form says it too.
	out, _, code := run(t, append([]string{"fleet", "gc", "--dry-run", "--id", "gc-budget-text", "--max-failures", "2"}, common...)...)
	if code != 2 || !strings.Contains(out, "rollout gc-budget-text: batches [1 2 4 3], 8 succeeded, 2 failed, 0 not started") ||
		!strings.Contains(out, "2 failed, max failures 2 (2 nodes): within it, every batch ran (Completed)") {
		t.Errorf("text output (exit %d):\n%s", code, out)
	}
	// A clean run within a budget exits 0.
	if _, errOut, code := run(t, "fleet", "gc", "--dry-run", "--id", "gc-budget-clean", "--max-failures", "50%", "--nats", srv.ClientURL(), "--nodes", "n1,n3,n4"); code != 0 {
		t.Errorf("clean run: exit %d\n%s", code, errOut)
	}

	// Resumed with the same id and no flag, the rollout keeps its recorded budget; follow shows it.
	res, _, code := jsonRun("gc-budget-within")
	if code != 2 || res.MaxFailures != "2" || res.FailureBudget != 2 || res.StopReason != events.RolloutCompleted || !slices.Equal(res.Batches, []int{1, 2, 4, 3}) {
		t.Errorf("resumed: exit %d, %+v", code, res)
	}
	for _, nr := range res.Nodes {
		if !nr.Resumed {
			t.Errorf("resumed: node %s acted on again", nr.Node)
		}
	}
	out, _, code = run(t, "fleet", "follow", "gc-budget-within", "--nats", srv.ClientURL())
	if code != 2 || !strings.Contains(out, "initial batch 1, max failures 2, dry run true") ||
		!strings.Contains(out, "finished: batches [1 2 4 3], 8 succeeded, 2 failed, 0 not started; max failures 2 (2 nodes): within it") {
		t.Errorf("fleet follow (exit %d):\n%s", code, out)
	}
}
