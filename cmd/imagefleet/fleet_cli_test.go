package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
)

// An IMAGEFLEET_* variable no test reads (a mistyped knob) stops the run before any test: docs/testing.md.
func init() { testenv.MustCheck() }

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
	serveScriptedGC(t, ctx, &wg, b, 2, func(node string) {
		mu.Lock()
		passes[node]++
		mu.Unlock()
	})
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

// serveScriptedGC answers every node's GC command (imagefleet.cmd.*.gc) on one connection with a scripted
// result removing `images` images of 1 MiB, calling pass for each request; it serves until ctx ends. Eight
// subscriptions share the subject in a queue group, so a burst of a thousand requests (a batch) does not
// overflow one subscription's buffer (a dropped request costs GCAction's 15 s attempt timeout).
func serveScriptedGC(t testing.TB, ctx context.Context, wg *sync.WaitGroup, b *bus.Bus, images int, pass func(node string)) {
	t.Helper()
	handle := func(_ context.Context, data []byte) (any, error) {
		var req events.GCRequest
		if err := events.DecodeStrict(data, &req); err != nil {
			return nil, err
		}
		_, node, _ := strings.Cut(req.ID, ".")
		if pass != nil {
			pass(node)
		}
		res := events.GCResult{Node: node, DryRun: req.DryRun, Skipped: []events.GCSkipped{{ID: "sha256:p", Why: "pinned"}}}
		for i := range images {
			res.Removed = append(res.Removed, events.GCRemoved{ID: fmt.Sprintf("sha256:%064x", i),
				RepoTags: []string{fmt.Sprintf("registry.example/app-%d:v1", i)}, Size: 1 << 20, Reason: "unused"})
		}
		return res, nil
	}
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = b.ServeConcurrent(ctx, events.Prefix+".cmd.*."+events.VerbGC, "scripted-gc", 64, handle)
		}()
	}
}

// BenchmarkFleetGCCommand runs the built `imagefleet fleet gc -o json` against 1,000 and 10,000 nodes
// answered by scripted GC responders (8 images each) on one connection in the benchmark's process, and
// reports the command's own peak RSS and CPU: the orchestrator's cost, measured on its process alone. The
// current binary runs with --max-in-flight 250, 1000 (the default) and 10000 (no cap at these sizes); with
// IMAGEFLEET_BASELINE_BINARY set to an earlier build, that binary runs too (bin=baseline), in the same run.
// rollout-stream-bytes/node is what the rollout wrote to IMAGEFLEET_ROLLOUTS per node (claim, outcome, and
// its share of the plan, batch and finished records).
func BenchmarkFleetGCCommand(b *testing.B) {
	type variant struct {
		name, bin string
		extra     []string
	}
	var bins []variant
	if base := testenv.String(b, "IMAGEFLEET_BASELINE_BINARY"); base != "" {
		bins = append(bins, variant{"baseline", base, nil})
	}
	for _, m := range []string{"250", "1000", "10000"} {
		bins = append(bins, variant{"current/inflight=" + m, binary, []string{"--max-in-flight", m}})
	}
	srv := bustest.Server(b)
	agents := bustest.Connect(b, srv)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	b.Cleanup(func() { cancel(); wg.Wait() })
	serveScriptedGC(b, ctx, &wg, agents, 8, nil)
	for _, n := range []int{1000, 10000} {
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("node-%05d", i)
		}
		for _, bin := range bins {
			b.Run(fmt.Sprintf("nodes=%d/bin=%s", n, bin.name), func(b *testing.B) {
				var rss int64
				var cpu time.Duration
				var streamBytes uint64
				for i := 0; i < b.N; i++ {
					before, _ := agents.Stream(ctx, events.RolloutStream) // absent before the first rollout
					args := append([]string{"fleet", "gc", "--all-unused", "--nats", srv.ClientURL(), "--nodes", strings.Join(names, ","),
						"--node-timeout", "2m", "--id", fmt.Sprintf("gc-bench-%d-%d", n, time.Now().UnixNano()), "-o", "json"}, bin.extra...)
					cmd := exec.Command(bin.bin, args...)
					var errb bytes.Buffer
					cmd.Stdout, cmd.Stderr = io.Discard, &errb
					if err := cmd.Run(); err != nil {
						b.Fatalf("fleet gc: %v\n%s", err, tailLines(errb.String(), 5))
					}
					after, err := agents.Stream(ctx, events.RolloutStream)
					if err != nil {
						b.Fatal(err)
					}
					streamBytes += after.Bytes - before.Bytes
					ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
					rss = max(rss, ru.Maxrss)
					cpu += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
				}
				b.ReportMetric(float64(streamBytes)/float64(b.N)/float64(n), "rollout-stream-bytes/node")
				b.ReportMetric(float64(rss)/1024, "peak-rss-MiB")
				b.ReportMetric(cpu.Seconds()/float64(b.N), "cpu-s/rollout")
				b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/rollout")
			})
		}
	}
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
