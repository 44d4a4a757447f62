package fleet_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestInventoryReadyMeansQueriesAnswered: the moment Ready closes, a query sent on another connection (as the
// CLI's) finds the replica: never "no responders". A replica whose Ready closed before its query subscription
// reached the server was late only now and then, so the test starts many replicas, each asked at once by a
// burst of queries.
func TestInventoryReadyMeansQueriesAnswered(t *testing.T) {
	const (
		starts  = 30
		queries = 10
	)
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv)
	var noResponders, failed atomic.Int64
	var firstErr atomic.Value
	for i := range starts {
		replica := fmt.Sprintf("ready-%d", i)
		inv, stop := runInventory(t, b, replica)
		select {
		case <-inv.Ready():
		case <-time.After(bustest.Timeout):
			t.Fatalf("%s: not ready after %s", replica, bustest.Timeout)
		}
		var wg sync.WaitGroup
		for range queries {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
				defer cancel()
				var rep events.InventoryReply
				err := client.Request(ctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryImages}, &rep)
				switch {
				case errors.Is(err, bus.ErrNoResponders):
					noResponders.Add(1)
				case err != nil:
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				case rep.Replica != replica || len(rep.Images) != 0:
					failed.Add(1)
					firstErr.CompareAndSwap(nil, fmt.Sprintf("answer %+v, want no images from %s", rep, replica))
				}
			}()
		}
		wg.Wait()
		stop()
	}
	if n := noResponders.Load(); n > 0 {
		t.Errorf("%d of %d queries sent after Ready found no responders", n, starts*queries)
	}
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of %d queries failed otherwise, first: %v", n, starts*queries, firstErr.Load())
	}
}
