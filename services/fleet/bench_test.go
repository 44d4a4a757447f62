package fleet_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

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
