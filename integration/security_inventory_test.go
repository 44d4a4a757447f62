package integration_test

import (
	"context"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestSecurityPartitionedInventory: two partitioned inventory replicas on the inventory identity alone take
// their partition leases, apply a node's image events and answer the fleet user's query from their
// gathered parts; the node's identity may neither ask for parts nor touch the leases.
func TestSecurityPartitionedInventory(t *testing.T) {
	const node = "node-a"
	s := startSecured(t, node)
	ctx := t.Context()
	nb := s.connect(t, node)
	fb := s.connect(t, natsconf.RoleFleet)
	var invs []*fleet.Inventory
	var stops []func()
	var conns []*bus.Bus
	for _, name := range []string{"inv-1", "inv-2"} {
		ib := s.connect(t, natsconf.RoleInventory)
		conns = append(conns, ib)
		inv, err := fleet.NewInventory(ctx, fleet.InventoryConfig{Replica: name, Partitioned: true}, ib)
		if err != nil {
			t.Fatal(err)
		}
		stop := bustest.RunService(t, inv)
		defer stop()
		invs, stops = append(invs, inv), append(stops, stop)
	}
	bustest.WaitWithin(t, "the replicas own the 16 partitions", 30*time.Second, func() bool {
		return len(invs[0].Owned())+len(invs[1].Owned()) == events.InventoryPartitions
	})
	ev, err := events.New(node, events.EntityImage, events.ActionDetected, events.ImageRecord{ID: "sha256:" + hex64("a"),
		RepoTags: []string{"docker.io/library/a:1"}, Size: 1234})
	if err != nil {
		t.Fatal(err)
	}
	if err := nb.Publish(ctx, ev); err != nil {
		t.Fatal(err)
	}
	where := func(what string) {
		t.Helper()
		var rep events.InventoryReply
		bustest.WaitWithin(t, what, 30*time.Second, func() bool {
			c, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			if err := fb.Request(c, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryWhere, Image: "a:1"}, &rep); err != nil {
				t.Logf("query: %v", err)
				return false
			}
			return rep.Total == 1 && len(rep.Placements) == 1 && rep.Placements[0].Node == node
		})
	}
	where("the fleet user sees the node's image")
	// inv-2 stops: inv-1 takes its partitions over and reads them from the bucket, on the same identity.
	stops[1]()
	start := time.Now()
	bustest.WaitWithin(t, "inv-1 owns the 16 partitions", 30*time.Second, func() bool { return len(invs[0].Owned()) == events.InventoryPartitions })
	t.Logf("inv-1 took inv-2's partitions over in %s", time.Since(start).Round(time.Millisecond))
	where("the fleet user sees the node's image after the takeover")
	// Nothing the replicas did was refused (a refused consumer delete at the end of a range made every
	// takeover wait out a 5 s API timeout).
	for i, ib := range conns {
		if v := ib.PermissionViolations(); len(v) > 0 {
			t.Errorf("inv-%d was refused %v", i+1, v)
		}
	}

	c, cancel := short(t)
	defer cancel()
	wantViolation(t, "a node asks for inventory parts", nb.Request(c, events.InventoryPartsSubject, events.InventoryQuery{What: events.InventoryNodes}, nil))
	c2, cancel2 := short(t)
	defer cancel2()
	kv, err := nb.KVExisting(c2, events.InventoryOwnersBucket)
	if err != nil {
		t.Fatal(err)
	}
	_, err = kv.Put(c2, events.InventoryLeaseKey(0), []byte(node))
	waitViolation(t, nb, "$KV."+events.InventoryOwnersBucket+"."+events.InventoryLeaseKey(0))
	if err == nil {
		t.Error("a node took a partition lease")
	}
}

func hex64(s string) string {
	out := make([]byte, 64)
	for i := range out {
		out[i] = s[0]
	}
	return string(out)
}
