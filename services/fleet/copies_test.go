package fleet_test

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestCopiesArbiterNeverGrantsBelowTheCount: four nodes hold an image (two per zone) and ask at once to remove
// it; the arbiter, over a real NATS, grants exactly as many removals as leave the count: fleet-wide with
// count 2, two; per zone with count 1, one in each zone. A dry run records nothing; a node the inventory
// shows gone no longer counts, and its grant no longer holds a copy back.
func TestCopiesArbiterNeverGrantsBelowTheCount(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	const img = "sha256:1111111111111111111111111111111111111111111111111111111111111111"
	nodes := []string{"n1", "n2", "n3", "n4"}
	zones := map[string]map[string]string{"n1": {"zone": "a"}, "n2": {"zone": "a"}, "n3": {"zone": "b"}, "n4": {"zone": "b"}}
	inv, err := b.KV(ctx, bus.KVConfig{Bucket: events.InventoryBucket})
	if err != nil {
		t.Fatal(err)
	}
	place := func(node string, gone bool) {
		raw, _ := json.Marshal(events.Placement{Node: node, ID: img, Size: 10, Gone: gone})
		if _, err := inv.Put(ctx, events.InventoryKey(img, node), raw); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range nodes {
		place(n, false)
	}
	a := fleet.NewCopiesArbiter(b, fleet.CopiesConfig{GrantTTL: time.Hour,
		Labels: func(context.Context) (map[string]map[string]string, error) { return zones, nil }})
	bustest.RunFunc(t, "copies arbiter", a.Run)

	ask := func(node string, count int, key string, dryRun bool) (bool, int) {
		var rep events.CopiesReply
		req := events.CopiesRequest{Node: node, Images: []string{img}, Count: count, TopologyKey: key, Zone: zones[node]["zone"], DryRun: dryRun}
		bustest.Eventually(t, "the arbiter answers "+node, 10*time.Second, func() error {
			c, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			return b.Request(c, events.CopiesSubject(node), req, &rep)
		})
		return slices.Contains(rep.Allowed, img), rep.Copies[img]
	}
	allAtOnce := func(count int, key string) []string {
		var mu sync.Mutex
		var granted []string
		var wg sync.WaitGroup
		for _, n := range nodes {
			wg.Go(func() {
				if ok, _ := ask(n, count, key, false); ok {
					mu.Lock()
					granted = append(granted, n)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		slices.Sort(granted)
		return granted
	}
	resetLedger := func() {
		kv, err := b.KV(ctx, fleet.CopiesBucketConfig())
		if err != nil {
			t.Fatal(err)
		}
		if err := kv.Delete(ctx, events.InventoryImageToken(img)); err != nil {
			t.Fatal(err)
		}
	}

	if ok, copies := ask("n1", 3, "", true); !ok || copies != 4 {
		t.Errorf("dry run, count 3 of 4: allowed %v, copies %d", ok, copies)
	}
	if ok, _ := ask("n1", 4, "", true); ok {
		t.Error("dry run, count 4 of 4: allowed")
	}
	if got := allAtOnce(2, ""); len(got) != 2 {
		t.Errorf("fleet-wide count 2: granted %v, want 2 of 4", got)
	}
	resetLedger()
	got := allAtOnce(1, "zone")
	if len(got) != 2 || (slices.Contains(got, "n1") == slices.Contains(got, "n2")) || (slices.Contains(got, "n3") == slices.Contains(got, "n4")) {
		t.Errorf("per zone count 1: granted %v, want one of n1, n2 and one of n3, n4", got)
	}

	// The zone a's granted node is gone: the other zone-a node is its zone's last copy.
	gone, kept := got[0], "n2"
	if gone == "n2" {
		kept = "n1"
	}
	place(gone, true)
	if ok, copies := ask(kept, 1, "zone", false); ok || copies != 1 {
		t.Errorf("the last copy of zone a: allowed %v, copies %d", ok, copies)
	}
}
