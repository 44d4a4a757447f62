package bus_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestWorkersReadOnlyWhatIsPublished: a push consumer pointed at a subject a worker serves (Listen) or watches
// (SubscribeSync, Subscribe) delivers there, as the server lets any client with consumer-create rights do; the
// worker never sees those messages, nor the consumer's idle heartbeats, and the bus counts each one. A
// request or a publish on the same subject still arrives. The cases run one after the other: the count is
// the process's.
func TestWorkersReadOnlyWhatIsPublished(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	reg := prometheus.NewRegistry()
	if err := bus.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	nc, js := bustest.JetStream(t, srv)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "STORED", Subjects: []string{"t.stored.>"}}); err != nil {
		t.Fatal(err)
	}
	const forged = 3
	for range forged {
		if _, err := js.Publish(ctx, "t.stored.a", []byte(`"forged"`)); err != nil {
			t.Fatal(err)
		}
	}
	// deliver points a push consumer at subject and waits until the bus has refused want more messages.
	deliver := func(t *testing.T, subject, group, filter string, heartbeat time.Duration, want float64) {
		t.Helper()
		before := refusedCount(t, reg)
		name := "to-" + t.Name()[len("TestWorkersReadOnlyWhatIsPublished/"):]
		if _, err := js.CreateOrUpdatePushConsumer(ctx, "STORED", jetstream.ConsumerConfig{Name: name, DeliverSubject: subject,
			DeliverGroup: group, FilterSubject: filter, IdleHeartbeat: heartbeat, AckPolicy: jetstream.AckNonePolicy}); err != nil {
			t.Fatalf("push consumer to %s: %v", subject, err)
		}
		t.Cleanup(func() { _ = js.DeleteConsumer(context.Background(), "STORED", name) })
		bustest.WaitFor(t, "the bus to refuse the consumer's deliveries", func() bool { return refusedCount(t, reg)-before >= want })
	}
	publish := func(t *testing.T, subject string) {
		t.Helper()
		if err := nc.Publish(subject, []byte(`"published"`)); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("served", func(t *testing.T) {
		var mu sync.Mutex
		var served []string
		l, err := b.Listen(ctx, "t.worker.serve", "q", 1, func(_ context.Context, data []byte) (any, error) {
			mu.Lock()
			defer mu.Unlock()
			served = append(served, string(data))
			return "ok", nil
		})
		if err != nil {
			t.Fatal(err)
		}
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() { _ = l.Serve(sctx) }()
		// The consumer names the worker's queue group, as it must to reach queue subscribers.
		deliver(t, "t.worker.serve", "q", "t.stored.>", 0, forged)
		var got string
		if err := b.Request(ctx, "t.worker.serve", []byte(`"asked"`), &got); err != nil || got != "ok" {
			t.Fatalf("request: %q, %v", got, err)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(served) != 1 || served[0] != `"asked"` {
			t.Errorf("the handler served %q, want the request only", served)
		}
	})
	t.Run("watched", func(t *testing.T) {
		sub, err := b.SubscribeSync(ctx, "t.worker.watch")
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		read := make(chan string, 1)
		go func() {
			_, data, _ := sub.Next(ctx)
			read <- string(data)
		}()
		deliver(t, "t.worker.watch", "", "t.stored.>", 0, forged)
		publish(t, "t.worker.watch")
		if got := <-read; got != `"published"` {
			t.Errorf("SubscribeSync read %q, want the publish", got)
		}
	})
	t.Run("subscribed", func(t *testing.T) {
		read := make(chan string, forged+1)
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() {
			_ = b.Subscribe(sctx, "t.worker.notice", func(_ string, _ map[string][]string, data []byte) { read <- string(data) })
		}()
		// Subscribe returns nothing when its subscription stands: a publish read back says it does.
		bustest.WaitFor(t, "the subscription", func() bool {
			publish(t, "t.worker.notice")
			select {
			case <-read:
				return true
			case <-time.After(20 * time.Millisecond):
				return false
			}
		})
		deliver(t, "t.worker.notice", "", "t.stored.>", 0, forged)
		publish(t, "t.worker.notice")
		if got := <-read; got != `"published"` {
			t.Errorf("Subscribe read %q, want the publish", got)
		}
	})
	t.Run("heartbeats", func(t *testing.T) {
		var mu sync.Mutex
		var served int
		l, err := b.Listen(ctx, "t.worker.quiet", "q", 1, func(context.Context, []byte) (any, error) {
			mu.Lock()
			defer mu.Unlock()
			served++
			return "ok", nil
		})
		if err != nil {
			t.Fatal(err)
		}
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() { _ = l.Serve(sctx) }()
		// A consumer of no message: what reaches the subject is its idle heartbeats.
		deliver(t, "t.worker.quiet", "q", "t.stored.none", 100*time.Millisecond, 2)
		mu.Lock()
		defer mu.Unlock()
		if served != 0 {
			t.Errorf("the handler served %d heartbeats", served)
		}
	})
}

func refusedCount(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "imagefleet_bus_consumer_deliveries_refused_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("imagefleet_bus_consumer_deliveries_refused_total not registered")
	return 0
}
