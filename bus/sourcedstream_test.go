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

// TestSourcedStreamMigratesInPlace: EnsureSourcedStream makes a stream that copies the origin's matching
// messages under the transformed subject, and a stream of an earlier release (another transform) is brought
// to the new one in place: later copies take the new subject, and the copies made before are kept, not
// made again.
func TestSourcedStreamMigratesInPlace(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	srv, b := bustest.Start(t)
	ctx := t.Context()
	cfg := bus.SourcedStreamConfig{Name: "COPY", Origin: events.EventsStream, Filter: events.ImageEventsFilter,
		Transform: "imagefleet.inv.old.{{wildcard(1)}}.image.>", WorkQueue: true, MaxAge: time.Hour}
	if err := b.EnsureSourcedStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	publish := func(node string) {
		ev, err := events.New(node, events.EntityImage, events.ActionDetected, events.ImageRecord{ID: "sha256:" + node})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	copies := func(want uint64) {
		t.Helper()
		bustest.WaitFor(t, fmt.Sprintf("%d copies", want), func() bool {
			info, err := b.Stream(ctx, "COPY")
			return err == nil && info.Messages >= want
		})
	}
	publish("n1")
	copies(1)
	cfg.Transform = events.InventorySourceTransform()
	if err := b.EnsureSourcedStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	publish("n2.zone")
	copies(2)
	// Read them back (raw: the stream's subjects are the point).
	_, js := bustest.JetStream(t, srv)
	s, err := js.Stream(ctx, "COPY")
	if err != nil {
		t.Fatal(err)
	}
	src := s.CachedInfo().Config.Sources
	if len(src) != 1 || len(src[0].SubjectTransforms) != 1 || src[0].SubjectTransforms[0].Destination != events.InventorySourceTransform() {
		t.Fatalf("sources after the migration: %+v", src)
	}
	var mu sync.Mutex
	var got []string
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := s.CreateOrUpdateConsumer(cctx, jetstream.ConsumerConfig{Durable: "probe", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := c.Fetch(10, jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		mu.Lock()
		got = append(got, m.Subject())
		mu.Unlock()
		_ = m.Ack()
	}
	want := []string{"imagefleet.inv.old.n1.image.detected", events.InventoryCopySubject("n2.zone", events.ActionDetected)}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("copies %q, want %q (the first copied once, before the migration)", got, want)
	}
	// Idempotent: a second ensure with the same settings changes nothing.
	if err := b.EnsureSourcedStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}
