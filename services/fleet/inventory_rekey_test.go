package fleet_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// putPlacement writes p under key, as a replica of either release would.
func putPlacement(t *testing.T, kv *bus.KV, key string, p events.Placement) {
	t.Helper()
	raw, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), key, raw); err != nil {
		t.Fatal(err)
	}
}

// bucketLayout returns every key of the inventory bucket, and those not in the image-first layout.
func bucketLayout(t *testing.T, kv *bus.KV) (keys, nodeFirst []string) {
	t.Helper()
	entries, err := kv.List(t.Context(), ">")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		var p events.Placement
		if err := json.Unmarshal(e.Value, &p); err != nil {
			t.Fatalf("%s: %v", e.Key, err)
		}
		keys = append(keys, e.Key)
		if e.Key != events.InventoryKey(p.ID, p.Node) {
			nodeFirst = append(nodeFirst, e.Key)
		}
	}
	slices.Sort(keys)
	return keys, nodeFirst
}

func wherePlacements(t *testing.T, b *bus.Bus, image string) []string {
	t.Helper()
	rep := query(t, b, events.InventoryQuery{What: events.InventoryWhere, Image: image})
	var out []string
	for _, p := range rep.Placements {
		out = append(out, fmt.Sprintf("%s/%d", p.Node, p.Size))
	}
	return out
}

// TestInventoryRekeysNodeFirstKeys upgrades an inventory in place: a bucket in the previous release's
// node-first layout (live placements, a tombstone, and a stale node-first key behind a newer image-first
// one) is re-keyed by a replica of this release before it answers; a replica of the previous release still
// running (it writes node-first keys) is followed; where, images and nodes answer from the new layout, and
// a previous-release replica, which indexes every key it watches, finds each placement once.
func TestInventoryRekeysNodeFirstKeys(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	kv, err := b.KVExisting(t.Context(), events.InventoryBucket)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	nginx, redis := "sha256:"+fmt.Sprintf("%064x", 1), "sha256:"+fmt.Sprintf("%064x", 2)
	pl := func(node, id, tag string, size int64, seq uint64) events.Placement {
		return events.Placement{Node: node, ID: id, RepoTags: []string{tag}, Size: size, LastUsed: now, Seq: seq}
	}
	// The previous release's bucket.
	putPlacement(t, kv, events.InventoryNodeFirstKey("n1", nginx), pl("n1", nginx, "docker.io/library/nginx:1.27", 100, 1))
	putPlacement(t, kv, events.InventoryNodeFirstKey("n2.example", nginx), pl("n2.example", nginx, "docker.io/library/nginx:1.27", 100, 2))
	putPlacement(t, kv, events.InventoryNodeFirstKey("n1", redis), pl("n1", redis, "docker.io/library/redis:7", 50, 3))
	putPlacement(t, kv, events.InventoryNodeFirstKey("n3", redis), events.Placement{Node: "n3", ID: redis, Seq: 4, Gone: true})
	// n3's redis came back later (seq 9, already written image first); its node-first key holds seq 5: stale.
	putPlacement(t, kv, events.InventoryKey(redis, "n3"), pl("n3", redis, "docker.io/library/redis:7", 50, 9))
	putPlacement(t, kv, events.InventoryNodeFirstKey("n3", redis), events.Placement{Node: "n3", ID: redis, Seq: 5, Gone: true})

	inv, stop := runInventory(t, b, "new")
	defer stop()
	bustest.WaitFor(t, "replica ready", func() bool {
		select {
		case <-inv.Ready():
			return true
		default:
			return false
		}
	})
	// The index is whole at once (node-first keys indexed under their image-first key); the bucket follows.
	if got, want := wherePlacements(t, b, "nginx:1.27"), []string{"n1/100", "n2.example/100"}; !slices.Equal(got, want) {
		t.Fatalf("where nginx at ready = %v, want %v", got, want)
	}
	bustest.WaitFor(t, "bucket re-keyed", func() bool {
		keys, nodeFirst := bucketLayout(t, kv)
		return len(nodeFirst) == 0 && len(keys) == 4
	})
	if got, want := wherePlacements(t, b, "nginx:1.27"), []string{"n1/100", "n2.example/100"}; !slices.Equal(got, want) {
		t.Fatalf("where nginx = %v, want %v", got, want)
	}
	if got, want := wherePlacements(t, b, redis), []string{"n1/50", "n3/50"}; !slices.Equal(got, want) {
		t.Fatalf("where redis = %v, want %v (n3's stale node-first tombstone must not win)", got, want)
	}
	images := query(t, b, events.InventoryQuery{What: events.InventoryImages})
	if images.Total != 2 || images.TotalBytes != 300 || images.Images[0].ID != nginx || images.Images[0].Nodes != 2 {
		t.Fatalf("images: %+v", images)
	}
	// A replica of the previous release, still running, applies an event: n2 loses nginx (seq 10) under the
	// node-first key. The new replica re-keys it; where follows.
	putPlacement(t, kv, events.InventoryNodeFirstKey("n2.example", nginx), events.Placement{Node: "n2.example", ID: nginx, Seq: 10, Gone: true})
	bustest.WaitFor(t, "node-first write re-keyed", func() bool {
		_, nodeFirst := bucketLayout(t, kv)
		return len(nodeFirst) == 0 && slices.Equal(wherePlacements(t, b, nginx), []string{"n1/100"})
	})
	nodes := query(t, b, events.InventoryQuery{What: events.InventoryNodes})
	if fmt.Sprintf("%+v", nodes.Nodes) != "[{Node:n1 Images:2 TotalBytes:150} {Node:n3 Images:1 TotalBytes:50}]" {
		t.Fatalf("nodes: %+v", nodes.Nodes)
	}
	// What a previous-release replica's index holds now: every key it watches, decoded, live ones kept.
	entries, err := kv.List(t.Context(), ">")
	if err != nil {
		t.Fatal(err)
	}
	var live []string
	for _, e := range entries {
		var p events.Placement
		if json.Unmarshal(e.Value, &p) == nil && !p.Gone {
			live = append(live, p.Node+"/"+p.ID[len(p.ID)-1:])
		}
	}
	slices.Sort(live)
	if want := []string{"n1/1", "n1/2", "n3/2"}; !slices.Equal(live, want) {
		t.Fatalf("previous-release view %v, want %v", live, want)
	}
	if st := inv.Stats(); st.Rekeyed < 5 {
		t.Fatalf("re-keyed %d, want at least 5", st.Rekeyed)
	}
}

// TestInventoryPages: images, nodes and where answer in pages that continue where the last ended, and
// Total counts every page.
func TestInventoryPages(t *testing.T) {
	_, b := bustest.Start(t)
	var evs []events.Event
	for n := range 7 {
		for i := range 5 {
			if i > n { // image i on nodes i..6: sizes and node counts differ
				continue
			}
			evs = append(evs, detected(t, fmt.Sprintf("n%d", n), fmt.Sprintf("sha256:%064x", i), fmt.Sprintf("img/%d:1", i), int64(100*(i+1))))
		}
	}
	if err := b.PublishAll(t.Context(), evs); err != nil {
		t.Fatal(err)
	}
	inv, stop := runInventory(t, b, "r")
	defer stop()
	bustest.WaitFor(t, "applied", func() bool { return inv.Stats().Applied == int64(len(evs)) })
	bustest.WaitFor(t, "indexed", func() bool {
		return query(t, b, events.InventoryQuery{What: events.InventoryNodes}).Total == 7
	})
	pages := func(q events.InventoryQuery, item func(events.InventoryReply) []string) (all []string, total int) {
		for range 20 {
			rep := query(t, b, q)
			all = append(all, item(rep)...)
			total = rep.Total
			if rep.Continue == "" {
				return all, total
			}
			q.Continue = rep.Continue
		}
		t.Fatalf("%+v: paging does not end", q)
		return nil, 0
	}
	imgs, total := pages(events.InventoryQuery{What: events.InventoryImages, Limit: 2}, func(r events.InventoryReply) (out []string) {
		for _, im := range r.Images {
			out = append(out, fmt.Sprintf("%s:%d", im.ID[len(im.ID)-1:], im.TotalBytes))
		}
		return out
	})
	// image i is on 7-i nodes of 100(i+1) bytes: 1: 1200, 2: 1500, 3: 1600, 4: 1500, 0: 700.
	if want := []string{"3:1600", "2:1500", "4:1500", "1:1200", "0:700"}; !slices.Equal(imgs, want) || total != 5 {
		t.Fatalf("images %v (total %d), want %v", imgs, total, want)
	}
	nodes, total := pages(events.InventoryQuery{What: events.InventoryNodes, Limit: 3}, func(r events.InventoryReply) (out []string) {
		for _, n := range r.Nodes {
			out = append(out, n.Node)
		}
		return out
	})
	if want := []string{"n0", "n1", "n2", "n3", "n4", "n5", "n6"}; !slices.Equal(nodes, want) || total != 7 {
		t.Fatalf("nodes %v (total %d)", nodes, total)
	}
	where, total := pages(events.InventoryQuery{What: events.InventoryWhere, Image: "img/2:1", Limit: 2}, func(r events.InventoryReply) (out []string) {
		for _, p := range r.Placements {
			out = append(out, p.Node)
		}
		return out
	})
	if want := []string{"n2", "n3", "n4", "n5", "n6"}; !slices.Equal(where, want) || total != 5 {
		t.Fatalf("where %v (total %d)", where, total)
	}
	rep, err := b.RequestRaw(t.Context(), events.InventoryQuerySubject, []byte(`{"what":"images","continue":"nonsense"}`))
	if err != nil || rep.Error == "" {
		t.Fatalf("bad continue token: %v %+v", err, rep)
	}
}
