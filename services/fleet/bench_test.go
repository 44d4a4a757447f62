package fleet_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/fleettest"
)

// peakHeap samples the process's heap in use until stop is called and returns the peak.
func peakHeap() (stop func() uint64) {
	var peak atomic.Uint64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
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
	}()
	return func() uint64 { close(done); wg.Wait(); return peak.Load() }
}

// BenchmarkFleetGC runs a fleet GC (dry run and real) over 1,000 hollow nodes in slow-start batches from 1
// (1, 2, 4 ... 256, 489: ten batches). The orchestrator has its own connection, so its message count per
// node is exact; peak heap is the whole process (the nats-server and the thousand hollow nodes included),
// an upper bound of the orchestrator's.
func BenchmarkFleetGC(b *testing.B) {
	for _, n := range []int{1000} {
		for _, dry := range []bool{true, false} {
			b.Run(fmt.Sprintf("nodes=%d/dryrun=%v", n, dry), func(b *testing.B) {
				srv := bustest.Server(b)
				agents := bustest.Connect(b, srv)
				orch := bustest.Connect(b, srv)
				hf := fleettest.StartHollowFleet(b, agents, n, 8)
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
						if err := hf.Refill(); err != nil {
							b.Fatal(err)
						}
						b.StartTimer()
					}
					before := orch.Stats()
					stop := peakHeap()
					r, err := fleet.NewRollout(fleet.RolloutConfig{Kind: events.RolloutGC, Nodes: hf.Names(), GC: &req, DryRun: dry,
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
					if want := int64(n) * 8 * (10 << 20); res.FreedBytes != want {
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

// BenchmarkInventoryApply measures image events applied per second by 1 and 2 inventory replicas sharing
// one durable consumer, from a stream holding 20,000 image.detected events (200 nodes x 100 images).
func BenchmarkInventoryApply(b *testing.B) {
	const nodes, images = 200, 100
	for _, replicas := range []int{1, 2} {
		b.Run(fmt.Sprintf("replicas=%d", replicas), func(b *testing.B) {
			var total time.Duration
			var applied int64
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				srv := bustest.Server(b)
				pub := bustest.Connect(b, srv)
				var evs []events.Event
				for n := range nodes {
					for j := range images {
						evs = append(evs, detected(b, fmt.Sprintf("node-%03d", n), fmt.Sprintf("sha256:%064x", j), fmt.Sprintf("img/%d:1", j), 1000))
					}
				}
				for k := 0; k < len(evs); k += 2000 {
					if err := pub.PublishAll(context.Background(), evs[k:min(k+2000, len(evs))]); err != nil {
						b.Fatal(err)
					}
				}
				ctx, cancel := context.WithCancel(context.Background())
				var invs []*fleet.Inventory
				var wg sync.WaitGroup
				for r := range replicas {
					conn := bustest.Connect(b, srv)
					inv, err := fleet.NewInventory(ctx, fleet.InventoryConfig{Replica: fmt.Sprintf("r%d", r)}, conn)
					if err != nil {
						b.Fatal(err)
					}
					invs = append(invs, inv)
				}
				b.StartTimer()
				began := time.Now()
				for _, inv := range invs {
					wg.Add(1)
					go func() { defer wg.Done(); _ = inv.Run(ctx) }()
				}
				want := int64(len(evs))
				deadline := time.Now().Add(5 * time.Minute)
				for {
					var got int64
					for _, inv := range invs {
						got += inv.Stats().Applied + inv.Stats().Duplicates
					}
					if got >= want {
						break
					}
					if time.Now().After(deadline) {
						b.Fatalf("applied %d of %d", got, want)
					}
					time.Sleep(5 * time.Millisecond)
				}
				total += time.Since(began)
				b.StopTimer()
				for _, inv := range invs {
					applied += inv.Stats().Applied
				}
				cancel()
				wg.Wait()
				b.StartTimer()
			}
			b.ReportMetric(float64(applied)/total.Seconds(), "events/s")
		})
	}
}
