package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// benchImages is how many unused images of 10 MiB each a benchmark's hollow node holds.
const benchImages = 8

// hollowFleetProc is an `imagefleet hollow` process of n agents (the real node workers over hollow CRI
// runtimes) on a nats-server of its own process, for the fleet benchmarks. A real GC removes the nodes'
// images; restart gives them back, as n agents restarting with fresh runtimes.
type hollowFleetProc struct {
	tb    testing.TB
	bin   string
	url   string
	b     *bus.Bus
	n     int
	runs  int
	proc  *proc
	names []string
}

func startHollowFleetProc(tb testing.TB, bin, url string, b *bus.Bus, n int) *hollowFleetProc {
	tb.Helper()
	h := &hollowFleetProc{tb: tb, bin: bin, url: url, b: b, n: n}
	h.start()
	return h
}

// start runs the process and waits until it says every agent runs and the registry holds every node
// with a start time of this run (a heartbeat of this process's agents, not the last one's).
func (h *hollowFleetProc) start() {
	h.tb.Helper()
	h.runs++
	began := time.Now()
	h.proc = startHollow(h.tb, h.bin, fmt.Sprintf("hollow-%d", h.runs), h.url, h.n, "--images-per-node", strconv.Itoa(benchImages),
		"--image-size", "10Mi", "--zones", "4", "--start-rate", "1000/s", "--image-gc-period", "1h")
	waitLogLine(h.tb, h.proc, fmt.Sprintf("hollow: %d agents running", h.n), 5*time.Minute)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		fresh, err := h.startedSince(began)
		if err == nil && len(fresh) == h.n {
			h.names = fresh
			return
		}
		if time.Now().After(deadline) {
			h.tb.Fatalf("%d of %d hollow nodes registered by this run after 3m (last error %v)\n%s", len(fresh), h.n, err, tail(h.proc.log, 20))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// startedSince returns the Ready hollow nodes whose agent started at or after t.
func (h *hollowFleetProc) startedSince(t time.Time) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	reg, err := fleet.OpenRegistry(ctx, h.b, fleet.RegistryOptions{})
	if err != nil {
		return nil, err
	}
	nodes, err := reg.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range nodes {
		if n.State == events.NodeReady && strings.HasPrefix(n.Node, "hollow-") && !n.Started.Before(t.Add(-time.Second)) {
			out = append(out, n.Node)
		}
	}
	return out, nil
}

// restart stops the process (SIGTERM) and starts a new one.
func (h *hollowFleetProc) restart() {
	h.tb.Helper()
	h.proc.stop(syscall.SIGTERM)
	h.start()
}

// peakHeap samples this process's heap in use until stop is called and returns the peak.
func peakHeap() (stop func() uint64) {
	var peak atomic.Uint64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		var ms runtime.MemStats
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			runtime.ReadMemStats(&ms)
			if ms.HeapInuse > peak.Load() {
				peak.Store(ms.HeapInuse)
			}
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	})
	return func() uint64 { close(done); wg.Wait(); return peak.Load() }
}

// BenchmarkFleetGC runs a fleet GC (dry run and real) in this process over 1,000 hollow agents with the
// real workers (`imagefleet hollow`, another process) in slow-start batches from 1 (1, 2, 4 ... 256, 489:
// ten batches); the nats-server is a third process (`imagefleet bus`). Each node's own GC executor answers:
// records from its detector's bucket, the eviction order, removal through CRI, image.removed and
// gc.finished events. The orchestrator has its own connection, so its message count per node is exact;
// peak heap is this process's (the orchestrator and the benchmark).
func BenchmarkFleetGC(b *testing.B) {
	bin := imagefleetBinary(b)
	for _, n := range []int{1000} {
		for _, dry := range []bool{true, false} {
			b.Run(fmt.Sprintf("nodes=%d/dryrun=%v", n, dry), func(b *testing.B) {
				url, orch := startBus(b, bin)
				hf := startHollowFleetProc(b, bin, url, orch, n)
				req := events.GCRequest{DryRun: dry, AllUnused: true}
				ctx := context.Background()
				if err := fleet.EnsureRolloutStream(ctx, orch, 1); err != nil {
					b.Fatal(err)
				}
				runtime.GC()
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				base := ms.HeapInuse
				var msgs uint64
				var peak uint64
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if !dry && i > 0 {
						b.StopTimer()
						hf.restart()
						b.StartTimer()
					}
					before := orch.Stats()
					stop := peakHeap()
					r, err := fleet.NewRollout(fleet.RolloutConfig{Kind: events.RolloutGC, Nodes: hf.names, GC: &req, DryRun: dry,
						NodeTimeout: 30 * time.Second}, orch, fleet.GCAction(orch, req))
					if err != nil {
						b.Fatal(err)
					}
					res, err := r.Run(ctx)
					peak = max(peak, stop())
					if err != nil {
						b.Fatal(err)
					}
					if res.Succeeded != n || len(res.Batches) != 10 {
						b.Fatalf("rollout: %d succeeded, batches %v, failed %v", res.Succeeded, res.Batches, res.Failed[:min(3, len(res.Failed))])
					}
					if want := int64(n) * benchImages * (10 << 20); res.FreedBytes != want {
						b.Fatalf("freed %d, want %d", res.FreedBytes, want)
					}
					after := orch.Stats()
					msgs += (after.OutMsgs - before.OutMsgs) + (after.InMsgs - before.InMsgs)
				}
				b.StopTimer()
				b.ReportMetric(float64(msgs)/float64(b.N)/float64(n), "msgs/node")
				b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
				b.ReportMetric(float64(peak-min(peak, base))/(1<<20), "peak-heap-growth-MiB")
				b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/rollout")
			})
		}
	}
}

// BenchmarkFleetCLI runs the built `imagefleet fleet gc` binary, as an operator would, against 1,000
// hollow agents with the real workers (`imagefleet hollow`, registered through their own heartbeats) on a
// nats-server of its own process, and reports the orchestrator process's own peak RSS, the wall time of
// the command (registry listing, selection, ten slow-start batches, recording) and its exit. With
// IMAGEFLEET_BENCH_MEMPROFILE set, the command writes the orchestrator's allocation profile there
// (--mem-profile).
func BenchmarkFleetCLI(b *testing.B) {
	bin := imagefleetBinary(b)
	for _, dry := range []bool{true, false} {
		b.Run(fmt.Sprintf("nodes=1000/dryrun=%v", dry), func(b *testing.B) {
			url, conn := startBus(b, bin)
			hf := startHollowFleetProc(b, bin, url, conn, 1000)
			var maxRSS int64
			var wall time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				if !dry && i > 0 {
					hf.restart()
				}
				args := []string{"fleet", "gc", "--all-unused", "--nats", url, "--node-timeout", "30s", "-o", "json"}
				if dry {
					args = append(args, "--dry-run")
				}
				if p := testenv.String(b, "IMAGEFLEET_BENCH_MEMPROFILE"); p != "" {
					args = append(args, "--mem-profile", p)
				}
				// The command runs under /usr/bin/time: the rusage of a child the test starts directly would report
				// this test process's peak (Linux keeps the old memory's high-water mark across the exec of a
				// vforked child), not the orchestrator's.
				rssFile := filepath.Join(b.TempDir(), "rss")
				cmd := exec.Command("/usr/bin/time", append([]string{"-f", "%M", "-o", rssFile, bin}, args...)...)
				var errb strings.Builder
				cmd.Stderr = &errb
				b.StartTimer()
				began := time.Now()
				out, err := cmd.Output()
				wall += time.Since(began)
				b.StopTimer()
				if err != nil {
					b.Fatalf("fleet gc: %v\n%s", err, errb.String())
				}
				var res events.RolloutResult
				if err := json.Unmarshal(out, &res); err != nil {
					b.Fatal(err)
				}
				if res.Succeeded != 1000 || len(res.Batches) != 10 {
					b.Fatalf("rollout: %d succeeded, batches %v", res.Succeeded, res.Batches)
				}
				if want := int64(1000) * benchImages * (10 << 20); res.FreedBytes != want {
					b.Fatalf("freed %d, want %d", res.FreedBytes, want)
				}
				raw, err := os.ReadFile(rssFile)
				if err != nil {
					b.Fatal(err)
				}
				kb, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
				if err != nil {
					b.Fatalf("maxrss %q: %v", raw, err)
				}
				maxRSS = max(maxRSS, kb)
				b.StartTimer()
			}
			b.StopTimer()
			b.ReportMetric(wall.Seconds()/float64(b.N), "s/rollout")
			b.ReportMetric(float64(maxRSS)/1024, "orchestrator-maxrss-MiB")
		})
	}
}
