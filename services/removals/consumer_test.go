package removals

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// startWorker runs a removals worker of node on b until the returned stop, once Ready.
func startWorker(t *testing.T, b *bus.Bus, cfg Config) (*Service, func()) {
	t.Helper()
	if cfg.Node == "" {
		cfg.Node = node
	}
	if cfg.Grace == 0 {
		cfg.Grace = time.Millisecond
	}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	s, err := New(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	stop := bustest.RunService(t, s)
	select {
	case <-s.Ready():
	case <-time.After(bustest.Timeout):
		stop()
		t.Fatalf("not ready after %v", bustest.Timeout)
	}
	return s, stop
}

// warnedIDs is the images the node's ImageRemovedExternally warnings name ("Image <id> (...) was removed
// ..."), in order.
func warnedIDs(t *testing.T, b *bus.Bus) []string {
	t.Helper()
	var ids []string
	for _, w := range warnings(t, b) {
		if f := strings.Fields(w.Message); w.Reason == ReasonImageRemovedExternally && len(f) > 1 {
			ids = append(ids, f[1])
		}
	}
	return ids
}

// wantWarned waits until the warnings name exactly want (in order).
func wantWarned(t *testing.T, b *bus.Bus, want ...string) {
	t.Helper()
	wantWarnedWithin(t, b, bustest.Timeout, want...)
}

// wantWarnedWithin is wantWarned with its own timeout.
func wantWarnedWithin(t *testing.T, b *bus.Bus, timeout time.Duration, want ...string) {
	t.Helper()
	bustest.Eventually(t, fmt.Sprintf("warnings of %v", want), timeout, func() error {
		if got := warnedIDs(t, b); !slices.Equal(got, want) {
			return fmt.Errorf("warned of %v", got)
		}
		return nil
	})
}

// drained waits until the worker's consumer has nothing pending nor in flight.
func drained(t *testing.T, b *bus.Bus) bus.ConsumerState {
	t.Helper()
	var st bus.ConsumerState
	bustest.Eventually(t, "the removals consumer drained", bustest.Timeout, func() (err error) {
		st, err = b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0) {
			err = fmt.Errorf("not drained: %+v", st)
		}
		return err
	})
	return st
}

// TestVanishedAfterReadyReportedOnce: a vanished event published after Ready is reported once (one warning,
// counted once, its consumer drained), by a consumer of one replica filtered to the node's vanished events.
func TestVanishedAfterReadyReportedOnce(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	s, stop := startWorker(t, b, Config{})
	defer stop()
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a1", Size: 1})
	wantWarned(t, b, "sha256:a1")
	st := drained(t, b)
	if st.Replicas != 1 || !slices.Equal(st.Filters, []string{events.EventSubject(node, events.EntityImage, events.ActionVanished)}) {
		t.Fatalf("consumer %+v, want one replica and the node's vanished filter", st)
	}
	// A second vanished event is reported too, the first not again.
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a2", Size: 1})
	wantWarned(t, b, "sha256:a1", "sha256:a2")
	drained(t, b)
	stop()
	if n := testutil.ToFloat64(s.counter); n != 2 {
		t.Fatalf("imagefleet_images_removed_externally_total = %v, want 2", n)
	}
	if got := warnedIDs(t, b); !slices.Equal(got, []string{"sha256:a1", "sha256:a2"}) {
		t.Fatalf("warned of %v after the worker stopped", got)
	}
}

// TestOnlyVanishedEventsDelivered: the consumer holds the node's image.vanished events only: the node's other
// events (image.detected, image.removed, gc.finished, node warnings) and other nodes' vanished events are not
// pending for it, a vanished event of the node is.
func TestOnlyVanishedEventsDelivered(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	_, stop := startWorker(t, b, Config{})
	stop() // the consumer stays, nobody pulls from it
	publish(t, b, events.ActionDetected, events.ImageRecord{ID: "sha256:b1", Size: 1})
	publish(t, b, events.ActionRemoved, events.ImageRemoved{ID: "sha256:b1", Size: 1, Reason: "space"})
	for _, ev := range []struct{ entity, action string }{{"gc", events.ActionFinished}, {events.EntityNode, events.ActionWarning}} {
		e, err := events.New(node, ev.entity, ev.action, map[string]string{"k": "v"})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Publish(t.Context(), e); err != nil {
			t.Fatal(err)
		}
	}
	other, err := events.New("node-2", events.EntityImage, events.ActionVanished, events.ImageRecord{ID: "sha256:b2"})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(t.Context(), other); err != nil {
		t.Fatal(err)
	}
	st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
	if err != nil || st.NumPending != 0 {
		t.Fatalf("consumer %+v, %v: want nothing pending for the node's other events", st, err)
	}
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:b2", Size: 1})
	if st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node)); err != nil || st.NumPending != 1 {
		t.Fatalf("consumer %+v, %v: want the node's vanished event pending", st, err)
	}
}

// TestRestartNeitherRepeatsNorMisses: a worker started again takes up after the last vanished event handled:
// one reported before is not reported again, one published while it was stopped is reported, and the
// removals published while it was stopped are known to it.
func TestRestartNeitherRepeatsNorMisses(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	first, stop := startWorker(t, b, Config{})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:c1", Size: 1})
	wantWarned(t, b, "sha256:c1")
	drained(t, b)
	stop()
	publish(t, b, events.ActionRemoved, events.ImageRemoved{ID: "sha256:d1", Size: 1, Reason: "space"})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:d1", Size: 1})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:c2", Size: 1})
	second, stop := startWorker(t, b, Config{})
	defer stop()
	wantWarned(t, b, "sha256:c1", "sha256:c2")
	drained(t, b)
	stop()
	if got := warnedIDs(t, b); !slices.Equal(got, []string{"sha256:c1", "sha256:c2"}) {
		t.Fatalf("warned of %v", got)
	}
	if n1, n2 := testutil.ToFloat64(first.counter), testutil.ToFloat64(second.counter); n1 != 1 || n2 != 1 {
		t.Fatalf("counted %v then %v, want 1 and 1", n1, n2)
	}
}

// TestUpgradeFromPreviousDurable: the worker takes over the previous layout's durable (the events stream's
// replicas, every event of the node): the vanished events it acked are not reported again, the ones it had
// not are; after it the durable has one replica and the vanished filter. The previous durable in memory
// storage cannot be updated in place (nats-server refuses a storage change): it is made anew after its ack
// floor, with the same outcome.
func TestUpgradeFromPreviousDurable(t *testing.T) {
	for _, memory := range []bool{false, true} {
		t.Run(fmt.Sprintf("memory=%v", memory), func(t *testing.T) {
			bustest.VerifyNoLeaks(t)
			_, b := bustest.Start(t)
			// The previous worker's durable, as it made it.
			if err := b.EnsureConsumer(t.Context(), previousConsumer(memory)); err != nil {
				t.Fatal(err)
			}
			publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a1", Size: 1}) // acked: reported before
			publish(t, b, events.ActionDetected, events.ImageRecord{ID: "sha256:a2", Size: 1})
			publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a2", Size: 1}) // delivered, handed back
			publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:b1", Size: 1}) // not delivered
			ackFirst(t, b, 2, memory)
			st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
			if err != nil || st.AckFloor != 2 {
				t.Fatalf("previous durable %+v, %v: want its first two events acked", st, err)
			}
			_, stop := startWorker(t, b, Config{})
			defer stop()
			wantWarned(t, b, "sha256:a2", "sha256:b1")
			st = drained(t, b)
			if st.Replicas != 1 || !slices.Equal(st.Filters, []string{events.EventSubject(node, events.EntityImage, events.ActionVanished)}) {
				t.Fatalf("consumer after the upgrade %+v, want one replica and the vanished filter", st)
			}
			stop()
			if got := warnedIDs(t, b); !slices.Equal(got, []string{"sha256:a2", "sha256:b1"}) {
				t.Fatalf("warned of %v", got)
			}
		})
	}
}

// ackFirst runs the previous worker's consumer (its settings, memory storage or not) until it acked the
// first n events of the node and holds the next one: then it stops, handing that one back (a nak), as the
// previous worker did when its agent stopped.
func ackFirst(t *testing.T, b *bus.Bus, n int, memory bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), bustest.Timeout)
	defer cancel()
	seen := 0
	err := b.Consume(ctx, previousConsumer(memory), func(hctx context.Context, m *bus.Msg) error {
		seen++
		if seen <= n {
			return nil
		}
		cancel()
		return ctx.Err()
	})
	if err != nil || seen != n+1 {
		t.Fatalf("previous consumer: %d events seen, want %d; %v", seen, n+1, err)
	}
}

// previousConsumer is the previous worker's durable: every event of the node, the stream's replicas.
func previousConsumer(memory bool) bus.ConsumerConfig {
	return bus.ConsumerConfig{Stream: events.EventsStream, Durable: events.RemovalsDurable(node),
		FilterSubjects: []string{events.NodeEvents(node)}, Concurrency: 1, MaxAckPending: 256,
		AckWait: time.Minute, MemoryStorage: memory}
}
