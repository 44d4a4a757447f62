package bus_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestConsumeOneAtATimeNeverStalls: a consumer handling one message at a time (PullMaxMessages(1)) goes
// through a backlog without a pause. nats.go v1.55.0's iterator skips a pull request asked for while its pull
// goroutine has not yet marked the previous one sent; with the previous batch (one message) already
// delivered, nothing was left at the server to wake it, and the consumer sat idle until nats.go missed two
// heartbeats (30 s): TestForeignRemovals's stall in CI. Under -race this failed 2 runs in 3 without the fix.
// The watchdog is out of the way (StallAfter an hour), so only the pull loop itself is measured.
func TestConsumeOneAtATimeNeverStalls(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	const n = 2000
	for i := range n {
		raw, _ := json.Marshal(i)
		if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
	var handled, last atomic.Int64
	last.Store(time.Now().UnixNano())
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "c", Concurrency: 1, MaxAckPending: 256, StallAfter: time.Hour},
			func(context.Context, *bus.Msg) error {
				handled.Add(1)
				last.Store(time.Now().UnixNano())
				return nil
			})
	}()
	// A pause of 10 s is a stall (the healthy loop hands out a message every few milliseconds, even under
	// -race on a loaded machine); the stall lasts 30 s.
	for handled.Load() < n {
		if idle := time.Since(time.Unix(0, last.Load())); idle > 10*time.Second {
			st, err := b.Consumer(ctx, "T", "c")
			t.Fatalf("stalled after %d of %d messages: none handled for %v; consumer %+v %v", handled.Load(), n, idle.Round(time.Second), st, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestConsumeStoppingHandsBackOnce: a consumer stopped while its handler runs hands the message back once:
// the next consumer gets it as its second delivery, not its third. The stopping consumer naks only after its
// pull subscription is gone, so the server cannot redeliver the nak'ed message into a pull request of the
// stopping consumer (which would hand it back again and spend a delivery of MaxDeliver):
// TestPullSurvivesRestart's Deliveries 3.
func TestConsumeStoppingHandsBackOnce(t *testing.T) {
	for _, conc := range []int{1, 4} {
		t.Run(fmt.Sprintf("concurrency=%d", conc), func(t *testing.T) {
			_, b := bustest.Start(t)
			if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}, WorkQueue: true}); err != nil {
				t.Fatal(err)
			}
			cfg := bus.ConsumerConfig{Stream: "T", Durable: "c", Concurrency: conc, MaxAckPending: conc}
			for range 5 {
				raw, _ := json.Marshal("job")
				if _, err := b.PublishCommand(t.Context(), "t.x", "", json.RawMessage(raw), nil); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(t.Context())
				started := make(chan struct{}, 1)
				done := make(chan error, 1)
				go func() {
					done <- b.Consume(ctx, cfg, func(ctx context.Context, m *bus.Msg) error {
						started <- struct{}{}
						<-ctx.Done()
						return ctx.Err()
					})
				}()
				<-started
				cancel()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				got := make(chan uint64, 1)
				ctx, cancel = context.WithCancel(t.Context())
				go func() {
					done <- b.Consume(ctx, cfg, func(ctx context.Context, m *bus.Msg) error {
						got <- m.NumDelivered
						return nil
					})
				}()
				select {
				case d := <-got:
					if d != 2 {
						t.Errorf("the next consumer got delivery %d, want 2 (one hand-back)", d)
					}
				case <-time.After(time.Minute):
					t.Fatal("the message never came back")
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
