package bus_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestConsumeAsyncAckDoesNotWait: a consumer with AsyncAck acks each handled message with a plain ack (no
// reply subject: nothing waits for the server to confirm it, so the handler's slot is free at once); the
// default stays the double ack, whose reply the handler's slot waits for. Seen on the wire by a
// subscription to the consumer's ack subjects; the acks reach the server either way (nothing left pending).
func TestConsumeAsyncAckDoesNotWait(t *testing.T) {
	for _, tc := range []struct {
		name      string
		async     bool
		wantReply bool
	}{
		{"double ack by default", false, true},
		{"async ack", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, b := bustest.Start(t)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}, WorkQueue: true}); err != nil {
				t.Fatal(err)
			}
			const n = 50
			for i := range n {
				raw, _ := json.Marshal(i)
				if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(raw), nil); err != nil {
					t.Fatal(err)
				}
			}
			// A plain subscriber sees every ack a client sends to the consumer, with its reply subject.
			spy, err := nats.Connect(srv.ClientURL())
			if err != nil {
				t.Fatal(err)
			}
			defer spy.Close()
			acks := make(chan *nats.Msg, 4*n)
			sub, err := spy.ChanSubscribe("$JS.ACK.T.c.>", acks)
			if err != nil {
				t.Fatal(err)
			}
			if err := spy.Flush(); err != nil {
				t.Fatal(err)
			}
			var handled atomic.Int64
			done := make(chan error, 1)
			go func() {
				done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "c", Concurrency: 4, MaxAckPending: 16,
					AsyncAck: tc.async}, func(context.Context, *bus.Msg) error {
					handled.Add(1)
					return nil
				})
			}()
			bustest.WaitWithin(t, "every message handled and its ack taken by the server", time.Minute, func() bool {
				st, err := b.Consumer(ctx, "T", "c")
				return handled.Load() == n && err == nil && st.NumPending == 0 && st.NumAckPending == 0
			})
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			bustest.WaitWithin(t, "every ack seen by the spy", 10*time.Second, func() bool { return len(acks) >= n })
			// Unsubscribed before reading, so nothing is sent on acks any more.
			if err := sub.Unsubscribe(); err != nil {
				t.Fatal(err)
			}
			got := 0
			for len(acks) > 0 {
				m := <-acks
				if string(m.Data) != "+ACK" {
					continue // a hand-back at the stop, none expected once all were handled
				}
				got++
				if hasReply := m.Reply != ""; hasReply != tc.wantReply {
					t.Errorf("ack on %s has reply subject %q: want a reply subject %v", m.Subject, m.Reply, tc.wantReply)
				}
			}
			if got != n {
				t.Fatalf("%d acks seen, want %d", got, n)
			}
		})
	}
}
