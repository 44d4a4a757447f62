package bus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestPerNodeConsumersPastOneThousand: besides the pull queue, every agent holds a consumer of its own on
// the shared events and pods streams (the removals worker's durable removals-<node> on IMAGEFLEET_EVENTS,
// the pod index's ordered consumer of its pod events on IMAGEFLEET_PODS), and nats-server counts every
// consumer, ordered ones too, against its default of 1,000 per stream. Both streams set MaxConsumers
// explicitly: 1,200 nodes' consumers are made on each.
func TestPerNodeConsumersPastOneThousand(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx := t.Context()
	const nodes = 1200
	t.Cleanup(func() { // a server holding thousands of file-store consumers is slow to shut down
		_ = b.DeleteStream(context.Background(), events.EventsStream)
	})
	run := func(t *testing.T, mk func(i int) error) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, nodes)
		next := make(chan int)
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					if err := mk(i); err != nil {
						errs <- fmt.Errorf("node %d: %w", i, err)
					}
				}
			}()
		}
		for i := range nodes {
			next <- i
		}
		close(next)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	t.Run("removals durables on the events stream", func(t *testing.T) {
		run(t, func(i int) error {
			node := fmt.Sprintf("hollow-%d", i)
			return b.EnsureConsumer(ctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: events.RemovalsDurable(node),
				FilterSubjects: []string{events.NodeEvents(node)}, Concurrency: 1, MaxAckPending: 256, AckWait: time.Minute})
		})
	})
	t.Run("ordered consumers on the pods stream", func(t *testing.T) {
		_, js := bustest.JetStream(t, srv)
		run(t, func(i int) error {
			_, err := js.OrderedConsumer(ctx, events.PodsStream, jetstream.OrderedConsumerConfig{
				FilterSubjects: []string{events.PodEventSubjects(fmt.Sprintf("hollow-%d", i))}})
			return err
		})
	})
}
