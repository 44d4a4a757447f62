package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestFleetGCStreamsItsOutput: `fleet gc -o json` writes the documented result ({batches, succeeded,
// failed, dryRun, nodes: [...]}) with nodes written as they end, and the text form a row per node and the
// totals; each node is acted on once, by the built binary against a real nats-server and scripted GC
// answers.
func TestFleetGCStreamsItsOutput(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	var mu sync.Mutex
	passes := map[string]int{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = b.ServeConcurrent(ctx, events.Prefix+".cmd.*."+events.VerbGC, "", 4, func(_ context.Context, data []byte) (any, error) {
			var req events.GCRequest
			if err := events.DecodeStrict(data, &req); err != nil {
				return nil, err
			}
			_, node, _ := strings.Cut(req.ID, ".")
			mu.Lock()
			passes[node]++
			mu.Unlock()
			res := events.GCResult{Node: node, DryRun: req.DryRun, Skipped: []events.GCSkipped{{ID: "sha256:p", Why: "pinned"}}}
			for i := range 2 {
				res.Removed = append(res.Removed, events.GCRemoved{ID: fmt.Sprintf("sha256:%d", i), RepoTags: []string{fmt.Sprintf("app-%d:v1", i)}, Size: 1 << 20, Reason: "unused"})
			}
			return res, nil
		})
	}()
	nodes := "n1,n2,n3,n4,n5"
	common := []string{"--nats", srv.ClientURL(), "--nodes", nodes, "--max-in-flight", "2"}
	bustest.Eventually(t, "the scripted GC answers", pollTimeout, func() error {
		var res events.GCResult
		return b.Request(t.Context(), events.CommandSubject("probe", events.VerbGC), events.GCRequest{ID: "probe.probe", DryRun: true}, &res)
	})

	out, errOut, code := run(t, append([]string{"fleet", "gc", "--dry-run", "--id", "gc-cli-dry", "-o", "json"}, common...)...)
	if code != 0 {
		t.Fatalf("fleet gc --dry-run: exit %d\n%s", code, errOut)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("output is not one JSON document: %v\n%s", err, out)
	}
	for _, k := range []string{"batches", "succeeded", "failed", "dryRun", "nodes", "failedCount", "freedBytes"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("output has no %q\n%s", k, out)
		}
	}
	var res events.RolloutResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, nr := range res.Nodes {
		got = append(got, nr.Node)
		if nr.GC == nil || len(nr.GC.Removed) != 2 {
			t.Errorf("node %s: %+v", nr.Node, nr.GC)
		}
	}
	slices.Sort(got)
	if !res.DryRun || res.Succeeded != 5 || len(res.Failed) != 0 || !slices.Equal(res.Batches, []int{1, 2, 2}) ||
		!slices.Equal(got, strings.Split(nodes, ",")) || res.FreedBytes != 5*2<<20 {
		t.Errorf("dry run result: %+v", res)
	}

	out, errOut, code = run(t, append([]string{"fleet", "gc", "--id", "gc-cli-real"}, common...)...)
	if code != 0 {
		t.Fatalf("fleet gc: exit %d\n%s", code, errOut)
	}
	for _, want := range []string{"NODE", "n4        3  2                  2.0 MiB  ok", "fleet total: freed 10.0 MiB",
		"rollout gc-cli-real: batches [1 2 2], 5 succeeded, 0 failed, 0 not started"} {
		if !strings.Contains(out, want) {
			t.Errorf("text output lacks %q:\n%s", want, out)
		}
	}
	// Resumed, the real run's compact records give the same totals.
	out, errOut, code = run(t, append([]string{"fleet", "gc", "--id", "gc-cli-real", "-o", "json"}, common...)...)
	if code != 0 {
		t.Fatalf("fleet gc again: exit %d\n%s", code, errOut)
	}
	res = events.RolloutResult{}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	if res.FreedBytes != 5*2<<20 || len(res.Nodes) != 5 || !res.Nodes[0].Resumed || res.Nodes[0].GCCounts == nil {
		t.Errorf("resumed result: %s", out)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range strings.Split(nodes, ",") {
		if passes[n] != 2 { // the dry run and the real one
			t.Errorf("%s: %d GC passes, want 2", n, passes[n])
		}
	}
}
