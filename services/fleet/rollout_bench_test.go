package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// sampleProcess samples the process's heap in use and its goroutines every 10 ms until stop is called, and
// returns the peaks.
func sampleProcess() (stop func() (heap uint64, goroutines int)) {
	var peakHeap atomic.Uint64
	var peakG atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var ms runtime.MemStats
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			runtime.ReadMemStats(&ms)
			peakHeap.Store(max(peakHeap.Load(), ms.HeapInuse))
			peakG.Store(max(peakG.Load(), int64(runtime.NumGoroutine())))
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() (uint64, int) { close(done); wg.Wait(); return peakHeap.Load(), int(peakG.Load()) }
}

// BenchmarkRolloutOrchestrator measures what a fleet GC costs the orchestrator itself at 1,000 and 10,000
// nodes: scripted GC responders (8 removed images per node, answered at once) on one connection, so the
// figures are the orchestrator's, not the agents'. Two modes in the same run:
//   - mode=hold-all is the orchestrator before the in-flight cap and result streaming: every node of a batch
//     acted on at once (MaxInFlight = the node count) and every outcome held for the result;
//   - mode=stream is `fleet gc -o json` now: at most DefaultMaxInFlight nodes at once, each outcome encoded to
//     the output (io.Discard here) as it arrives and dropped.
//
// peak-heap-growth-MiB is the process's peak heap in use above its level before the rollout (the server and
// responders share the process; they do the same work in both modes, so the difference between the modes
// is the orchestrator's); peak-goroutines the process's peak.
func BenchmarkRolloutOrchestrator(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		for _, mode := range []string{"hold-all", "stream"} {
			b.Run(fmt.Sprintf("nodes=%d/mode=%s", n, mode), func(b *testing.B) {
				srv := bustest.Server(b)
				agents := bustest.Connect(b, srv)
				orch := bustest.Connect(b, srv)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				s := newScriptedGC(8)
				s.serve(b, ctx, agents)
				nodes := make([]string, n)
				for i := range nodes {
					nodes[i] = fmt.Sprintf("node-%05d", i)
				}
				if err := fleet.EnsureRolloutStream(ctx, orch, 1); err != nil {
					b.Fatal(err)
				}
				var peakGrowth uint64
				var peakG int
				var msgs uint64
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					runtime.GC()
					var ms runtime.MemStats
					runtime.ReadMemStats(&ms)
					base := ms.HeapInuse
					id := fleet.NewRolloutID("gc")
					req := events.GCRequest{ID: id, AllUnused: true}
					cfg := fleet.RolloutConfig{ID: id, Kind: events.RolloutGC, Nodes: nodes, GC: &req, NodeTimeout: time.Minute}
					if mode == "hold-all" {
						cfg.MaxInFlight = n
					} else {
						enc := json.NewEncoder(io.Discard)
						cfg.Results = func(nr events.RolloutNodeResult) { _ = enc.Encode(nr) }
					}
					r, err := fleet.NewRollout(cfg, orch, fleet.GCAction(orch, req))
					if err != nil {
						b.Fatal(err)
					}
					before := orch.Stats()
					stop := sampleProcess()
					b.StartTimer()
					res, err := r.Run(ctx)
					b.StopTimer()
					heap, g := stop()
					if err != nil {
						b.Fatal(err)
					}
					if res.Succeeded != n {
						b.Fatalf("rollout: %d succeeded, failed %v", res.Succeeded, res.Failed[:min(3, len(res.Failed))])
					}
					if want := int64(n) * 8 * (10 << 20); res.FreedBytes != want {
						b.Fatalf("freed %d, want %d", res.FreedBytes, want)
					}
					after := orch.Stats()
					msgs += (after.OutMsgs - before.OutMsgs) + (after.InMsgs - before.InMsgs)
					peakGrowth = max(peakGrowth, heap-min(heap, base))
					peakG = max(peakG, g)
					b.StartTimer()
				}
				b.StopTimer()
				b.ReportMetric(float64(msgs)/float64(b.N)/float64(n), "msgs/node")
				b.ReportMetric(float64(peakGrowth)/(1<<20), "peak-heap-growth-MiB")
				b.ReportMetric(float64(peakG), "peak-goroutines")
				b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/rollout")
			})
		}
	}
}
