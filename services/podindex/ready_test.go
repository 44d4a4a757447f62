package podindex

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

// TestReadyMeansQueriesAnswered: once Ready has closed, a pods query sent from another connection finds a
// responder. A fresh index has nothing to catch up with and closes Ready a millisecond or two after Run
// starts, so its query subscriptions must be at the server by then. Started from goroutines, a subscription
// was late whenever the thread running its goroutine lost its CPU for a few milliseconds in between (a busy
// node): then every query of the burst got no responders. That is rare per start, so the test starts many
// indexes, each asked at once by a burst of queries.
func TestReadyMeansQueriesAnswered(t *testing.T) {
	const (
		starts  = 200
		queries = 10 // per start, all at once: 2,000 in all
	)
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv) // the asker is not the worker's connection, as in an agent
	var noResponders, failed atomic.Int64
	var firstErr atomic.Value
	late := 0 // starts with a query that found no responders
	for i := range starts {
		node := fmt.Sprintf("ready-%d.example", i) // a new node each time: nothing to catch up with
		s, err := New(Config{Node: node}, b)
		if err != nil {
			t.Fatal(err)
		}
		done, stop := runService(s)
		select {
		case <-s.Ready():
		case err := <-done:
			t.Fatalf("%s: run: %v", node, err)
		case <-time.After(bustest.Timeout):
			t.Fatalf("%s: not ready after %v", node, bustest.Timeout)
		}
		subject := events.QuerySubject(node, events.QryPods)
		before := noResponders.Load()
		var wg sync.WaitGroup
		for range queries {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var rep events.PodsReply
				ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
				defer cancel()
				err := client.Request(ctx, subject, events.PodsQuery{}, &rep)
				switch {
				case errors.Is(err, bus.ErrNoResponders):
					noResponders.Add(1)
				case err != nil:
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}()
		}
		wg.Wait()
		if noResponders.Load() > before {
			late++
		}
		if err := stop(); err != nil {
			t.Fatalf("%s: run returned %v", node, err)
		}
	}
	if n := noResponders.Load(); n > 0 {
		t.Errorf("%d of %d pods queries sent after Ready found no responders (after %d of %d starts)",
			n, starts*queries, late, starts)
	}
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of %d pods queries failed otherwise, first: %v", n, starts*queries, firstErr.Load())
	}
}
