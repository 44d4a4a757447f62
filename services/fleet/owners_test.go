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

// TestOwnersKeepALeaseWhoseRenewalWasStoredUnanswered: a renewal that timed out under load can have been
// stored all the same, so the lease's revision is past the one the replica holds and its next renewal
// conflicts with its own write. The lease still names the replica: it keeps it, instead of releasing the
// partition and taking it back (unanswered meanwhile, and read again from the whole bucket). A lease that
// names another replica is lost, as before.
func TestOwnersKeepALeaseWhoseRenewalWasStoredUnanswered(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	kv, err := b.KV(ctx, ownersBucket(1))
	if err != nil {
		t.Fatal(err)
	}
	var released []int
	o := newOwners(kv, "me", slog.Default(), func(_, rel []int) { released = append(released, rel...) })
	o.round(ctx) // alone: it takes all 16
	if got := len(o.heldSorted()); got != events.InventoryPartitions {
		t.Fatalf("held %d partitions after the first round, want %d", got, events.InventoryPartitions)
	}
	// Partition 0's renewal stored, its answer never heard: the lease names "me" at a revision not held.
	if _, err := kv.Put(ctx, events.InventoryLeaseKey(0), []byte("me")); err != nil {
		t.Fatal(err)
	}
	o.round(ctx)
	if len(released) != 0 || !o.valid(0) {
		t.Fatalf("released %v, partition 0 valid %v: want the lease kept", released, o.valid(0))
	}
	o.round(ctx) // renewed on the revision reclaimed: no conflict
	if len(released) != 0 || !o.valid(0) {
		t.Fatalf("next round: released %v, partition 0 valid %v: want the lease kept", released, o.valid(0))
	}
	// Partition 1's lease taken by another replica: lost.
	if _, err := kv.Put(ctx, events.InventoryLeaseKey(1), []byte("other")); err != nil {
		t.Fatal(err)
	}
	o.round(ctx)
	if len(released) != 1 || released[0] != 1 || o.valid(1) {
		t.Fatalf("released %v, partition 1 valid %v: want partition 1 lost", released, o.valid(1))
	}
}
