package fleet

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// TestInventoryTotalsMatchAScan: the per-image and per-node totals the index keeps as placements come, change
// size, go and come back (half of them written by this replica, then echoed by the watch) answer images and
// nodes exactly as a scan of the live placements does (Answer).
func TestInventoryTotalsMatchAScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 1))
	inv := newInventory(InventoryConfig{Replica: "r"})
	live := map[string]events.Placement{} // key -> the last value, when live
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for seq := uint64(1); seq <= 3000; seq++ {
		node, id := fmt.Sprintf("n%d.example", rng.IntN(12)), fmt.Sprintf("sha256:%064x", rng.IntN(9))
		key := events.InventoryKey(id, node)
		p := events.Placement{Node: node, ID: id, Seq: seq}
		switch r := rng.IntN(10); {
		case r < 6:
			p.Size = int64(100 + rng.IntN(5))
			p.LastUsed = base.Add(time.Duration(rng.IntN(1000)) * time.Second)
			p.RepoTags = []string{fmt.Sprintf("img/%s:%d", id[len(id)-1:], rng.IntN(2))}
			live[key] = p
		case r < 9:
			p.Gone = true
			delete(live, key)
		default: // the key deleted
			inv.indexEntry(bus.Entry{Key: key, Deleted: true})
			delete(live, key)
			continue
		}
		raw, _ := json.Marshal(p)
		if rng.IntN(2) == 0 {
			// This replica's own write, indexed as written, then its echo from the watch.
			inv.wrote(key, p, seq)
		}
		inv.indexEntry(bus.Entry{Key: key, Value: raw, Revision: seq})
		if seq%500 != 0 {
			continue
		}
		placements := make([]events.Placement, 0, len(live))
		for _, p := range live {
			placements = append(placements, p)
		}
		for _, what := range []string{events.InventoryImages, events.InventoryNodes} {
			q := events.InventoryQuery{What: what}
			want, err := Answer(q, placements)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := json.Marshal(q)
			out, err := inv.Query(t.Context(), raw)
			if err != nil {
				t.Fatal(err)
			}
			got := out.(events.InventoryReply)
			got.Replica = ""
			for _, rep := range []*events.InventoryReply{&want, &got} {
				for i := range rep.Images {
					slices.Sort(rep.Images[i].RepoTags)
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("after %d changes, %s:\n got %+v\nwant %+v", seq, what, got, want)
			}
		}
	}
}

// TestInventoryEchoNotDecodedAgain: the watch's echo of this replica's own write (same key, same revision) is
// recognized without decoding its value; any other revision of the key is decoded as before.
func TestInventoryEchoNotDecodedAgain(t *testing.T) {
	inv := newInventory(InventoryConfig{Replica: "r"})
	p := events.Placement{Node: "n1", ID: "sha256:" + strings.Repeat("a", 64), Size: 10, Seq: 5, RepoTags: []string{"img:1"}}
	key := events.InventoryKey(p.ID, p.Node)
	inv.wrote(key, p, 7)
	// A value that is no placement at the written revision: the echo, not decoded, changes nothing.
	inv.indexEntry(bus.Entry{Key: key, Value: []byte("not a placement"), Revision: 7})
	if cur, ok := inv.lookup(p); !ok || cur.rev != 7 || cur.Seq != 5 || inv.images[p.ID].nodes != 1 {
		t.Fatalf("after the echo: %+v %v, image totals %+v", cur, ok, inv.images[p.ID])
	}
	// Another replica's later write is decoded and indexed.
	q := p
	q.Seq, q.Size = 6, 20
	raw, _ := json.Marshal(q)
	inv.indexEntry(bus.Entry{Key: key, Value: raw, Revision: 9})
	if cur, ok := inv.lookup(p); !ok || cur.rev != 9 || cur.Seq != 6 || inv.images[p.ID].bytes != 20 {
		t.Fatalf("after another replica's write: %+v %v, image totals %+v", cur, ok, inv.images[p.ID])
	}
	// The same bad value at a revision the index does not hold is decoded, fails, and drops the key.
	inv.indexEntry(bus.Entry{Key: key, Value: []byte("not a placement"), Revision: 10})
	if cur, ok := inv.lookup(p); ok || inv.images[p.ID] != nil {
		t.Fatalf("a bad value at a new revision kept %+v, image totals %+v", cur, inv.images[p.ID])
	}
}
