package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestPublishHearsOfALostAck: an asynchronous publish whose ack never comes (here a subscriber takes the
// message and never answers; in a cluster, the server that stored it died before answering) returns an
// error within the ack timeout instead of waiting forever. A detector once held its lock in such a wait
// (KV.Batch) after a cluster lost a server, and every GC request of its node waited behind it.
func TestPublishHearsOfALostAck(t *testing.T) {
	srv := bustest.Server(t)
	b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{Name: t.Name(), PublishAckTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	sub := make(chan error, 1)
	go func() {
		sub <- b.Subscribe(ctx, "imagefleet.test.silent", func(string, map[string][]string, []byte) {})
	}()
	// The subscription is in place once a publish no longer finds no responders.
	bustest.Eventually(t, "the silent subscriber", 10*time.Second, func() error {
		_, err := b.PublishMsgs(t.Context(), []bus.RawMsg{{Subject: "imagefleet.test.silent", Data: []byte("x")}})
		if errors.Is(err, jetstream.ErrAsyncPublishTimeout) {
			return nil
		}
		return err
	})
	began := time.Now()
	_, err = b.PublishMsgs(context.Background(), []bus.RawMsg{{Subject: "imagefleet.test.silent", Data: []byte("y")}})
	if !errors.Is(err, jetstream.ErrAsyncPublishTimeout) {
		t.Fatalf("publish with its ack lost: %v, want %v", err, jetstream.ErrAsyncPublishTimeout)
	}
	if d := time.Since(began); d > 5*time.Second {
		t.Fatalf("publish with its ack lost returned after %s, want about the 1s ack timeout", d)
	}
	cancel()
	if err := <-sub; err != nil {
		t.Fatal(err)
	}
}
