package fleet

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// TestInventoryTotalsMatchAScan: the per-image and per-node totals the index keeps as placements come, change
// size, go and come back answer images and nodes exactly as a scan of the live placements does (Answer).
func TestInventoryTotalsMatchAScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 1))
	inv := &Inventory{cfg: InventoryConfig{Replica: "r"}, index: map[string]map[string]indexed{},
		refs: map[string]map[string]int{}, images: map[string]*imageTotals{}, nodes: map[string]*events.InventoryNode{}}
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
		inv.indexEntry(bus.Entry{Key: key, Value: raw})
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
