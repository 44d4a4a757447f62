package bus_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestConsumeStartedOnceConsumerIsUp: Started is called once, when the consumer exists and its pull request
// is at the server. The consumer delivers only what is stored after it is made (DeliverNew), so a message
// published right after Started is handled only if Started did not come before the consumer.
func TestConsumeStartedOnceConsumerIsUp(t *testing.T) {
	_, b := bustest.Start(t)
	if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	var calls, handled atomic.Int32
	stop := bustest.RunFunc(t, "consume", func(ctx context.Context) error {
		return b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "c", DeliverNew: true, Concurrency: 1,
			Started: func() {
				if calls.Add(1) == 1 {
					close(started)
				}
			}},
			func(context.Context, *bus.Msg) error { handled.Add(1); return nil })
	})
	defer stop()
	select {
	case <-started:
	case <-time.After(bustest.Timeout):
		t.Fatalf("Started not called within %v", bustest.Timeout)
	}
	if _, err := b.Consumer(t.Context(), "T", "c"); err != nil {
		t.Fatalf("consumer once Started was called: %v", err)
	}
	if _, err := b.PublishCommand(t.Context(), "t.x", "", "first", nil); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the message published after Started handled", func() bool { return handled.Load() == 1 })
	if _, err := b.PublishCommand(t.Context(), "t.x", "", "second", nil); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the second message handled", func() bool { return handled.Load() == 2 })
	if n := calls.Load(); n != 1 {
		t.Errorf("Started called %d times, want once", n)
	}
}

// TestConsumeStartedNotForAMissingBoundConsumer: a consumer bound to a durable that does not exist fails
// without calling Started; bound once the durable exists, it calls Started.
func TestConsumeStartedNotForAMissingBoundConsumer(t *testing.T) {
	_, b := bustest.Start(t)
	if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	cfg := bus.ConsumerConfig{Stream: "T", Durable: "bound", Bind: true, Concurrency: 1,
		Started: func() { calls.Add(1) }}
	nop := func(context.Context, *bus.Msg) error { return nil }
	if err := b.Consume(t.Context(), cfg, nop); !bus.IsConsumerNotFound(err) {
		t.Fatalf("consume of a missing bound consumer: %v, want consumer not found", err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("Started called %d times for a consumer that does not exist", n)
	}
	if err := b.EnsureConsumer(t.Context(), bus.ConsumerConfig{Stream: "T", Durable: "bound"}); err != nil {
		t.Fatal(err)
	}
	stop := bustest.RunFunc(t, "consume", func(ctx context.Context) error { return b.Consume(ctx, cfg, nop) })
	defer stop()
	bustest.WaitFor(t, "Started of the bound consumer", func() bool { return calls.Load() == 1 })
}
