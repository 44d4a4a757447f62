package bus_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// tailBus starts a server and connects a bus to it through a proxy that can lose its requests, logging to
// logs, with stream T (t.>).
func tailBus(t *testing.T, logs *bustest.SyncBuffer) (*bus.Server, *bustest.Proxy, *bus.Bus) {
	t.Helper()
	srv := bustest.Server(t)
	proxy := bustest.NewProxy(t, srv)
	b, err := bus.Connect(t.Context(), proxy.URL(), bus.Options{Name: t.Name(), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	return srv, proxy, b
}

// publishN publishes n messages on t.x.
func publishN(t *testing.T, b *bus.Bus, n int) {
	t.Helper()
	for i := range n {
		raw, _ := json.Marshal(i)
		if _, err := b.PublishCommand(t.Context(), "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTailNoticesALostPull: a Tail's pull request lost on its way (a server that went away, one that dropped
// it) is noticed within seconds by its missing heartbeats, counted, logged and sent again. nats.go's ordered
// iterator that Tail read with noticed it after two missed 5 s heartbeats: the stored message waited 10.0 s.
func TestTailNoticesALostPull(t *testing.T) {
	var logs bustest.SyncBuffer
	_, proxy, b := tailBus(t, &logs)
	publishN(t, b, 1)
	before := lostPulls(t, "tail:T", "no_heartbeat")
	lost := proxy.DropNext(1, func(subject string) bool { return strings.HasPrefix(subject, "$JS.API.CONSUMER.MSG.NEXT.T.") })
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	got := make(chan time.Time, 4)
	done := make(chan error, 1)
	go func() {
		done <- b.Tail(ctx, "T", "t.>", 0, func(bus.StreamMsg) error {
			got <- time.Now()
			return nil
		})
	}()
	var lostAt time.Time
	select {
	case <-lost:
		lostAt = time.Now()
	case <-time.After(time.Minute):
		t.Fatal("Tail sent no pull request within a minute")
	}
	select {
	case at := <-got:
		// Two missed heartbeats (2 s) and the time to send the request again; 10 s before.
		if d := at.Sub(lostAt); d > 7*time.Second {
			t.Fatalf("delivered %v after the pull request was lost, want it noticed and sent again within seconds", d.Round(time.Millisecond))
		}
	case <-time.After(time.Minute):
		t.Fatal("nothing delivered within a minute of the pull request lost")
	}
	if n := lostPulls(t, "tail:T", "no_heartbeat") - before; n < 1 {
		t.Errorf("imagefleet_bus_pulls_lost_total{consumer=tail:T,reason=no_heartbeat} rose by %v, want at least 1", n)
	}
	if l := logs.String(); !strings.Contains(l, "pull request lost; pulling anew") || !strings.Contains(l, "reason=no_heartbeat") {
		t.Errorf("no log line of the lost pull request:\n%s", l)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Tail after its context ended: %v, want nil", err)
	}
}

// TestTailGoesOnAfterItsConsumerIsDeleted: a Tail whose consumer is deleted under it (its server lost it, the
// server removed it) makes one anew after the last message it took: the messages come once each, in order.
func TestTailGoesOnAfterItsConsumerIsDeleted(t *testing.T) {
	var logs bustest.SyncBuffer
	srv, _, b := tailBus(t, &logs)
	publishN(t, b, 3)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	seqs := make(chan uint64, 16)
	done := make(chan error, 1)
	go func() {
		done <- b.Tail(ctx, "T", "t.>", 2, func(m bus.StreamMsg) error {
			seqs <- m.Seq
			return nil
		})
	}()
	var got []uint64
	take := func(n int) {
		t.Helper()
		for range n {
			select {
			case s := <-seqs:
				got = append(got, s)
			case <-time.After(30 * time.Second):
				t.Fatalf("Tail gave %v, then nothing for 30 s", got)
			}
		}
	}
	take(2)
	// Its consumer, found with a connection of its own.
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, "T")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for name := range stream.ConsumerNames(ctx).Name() {
		names = append(names, name)
	}
	if len(names) != 1 || !strings.HasPrefix(names[0], "tail_") {
		t.Fatalf("consumers of T: %v, want the Tail's one", names)
	}
	if err := js.DeleteConsumer(ctx, "T", names[0]); err != nil {
		t.Fatal(err)
	}
	publishN(t, b, 3)
	take(3)
	if want := []uint64{2, 3, 4, 5, 6}; !slices.Equal(got, want) {
		t.Fatalf("Tail from 2 gave %v across its consumer's deletion, want %v", got, want)
	}
	select {
	case s := <-seqs:
		t.Fatalf("Tail gave %d more after %v", s, got)
	default:
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Tail after its context ended: %v, want nil", err)
	}
}
