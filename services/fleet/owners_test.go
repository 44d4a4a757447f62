package fleet

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestOwnersCountReplicasWithAClockAhead: a replica whose clock runs ahead of the server's by more than
// the TTL still counts a replica that renews its member key. A key read at start is dated by the server's
// write time (a killed replica's key expires from its last renewal); one written later is dated when this
// replica sees it, by its own clock. Dated by the server's time, every renewal looked expired: the share
// was all 16 partitions, and a gather round ended after the first part.
func TestOwnersCountReplicasWithAClockAhead(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	kv, err := b.KV(ctx, ownersBucket(1))
	if err != nil {
		t.Fatal(err)
	}
	// A member key written long ago by the server's clock: expired, as at a start after a kill.
	if _, err := kv.Put(ctx, events.InventoryMemberKey("old"), []byte("old")); err != nil {
		t.Fatal(err)
	}
	o := newOwners(kv, "me", slog.Default(), func(_, _ []int) {})
	ahead := 3 * ownersTTL
	o.now = func() time.Time { return time.Now().Add(ahead) }
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- o.watch(ctx, ready) }()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		t.Fatal("the owners watch did not load")
	}
	if n := o.replicas(); n != 1 {
		t.Fatalf("replicas at start = %d, want 1 (the key read at start is %s old by this clock)", n, ahead)
	}
	// Another replica renews its member key after the start.
	if _, err := kv.Put(ctx, events.InventoryMemberKey("other"), []byte("other")); err != nil {
		t.Fatal(err)
	}
	bustest.WaitWithin(t, "the other replica counted", 10*time.Second, func() bool { return o.replicas() == 2 })
	if got := o.share(); got != events.InventoryPartitions/2 {
		t.Fatalf("share = %d, want %d", got, events.InventoryPartitions/2)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
