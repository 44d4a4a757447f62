package fleet

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// TestImagesChunkFollowsTheImageSet reads a part's images in chunks while images come, then go, between the
// chunks: each chunk must be the next images after the cursor in ID order of the index as it is then, with
// their totals, whatever was sorted for an earlier chunk.
func TestImagesChunkFollowsTheImageSet(t *testing.T) {
	s := newInventory(InventoryConfig{})
	rev := uint64(0)
	put := func(img int, node string) {
		t.Helper()
		rev++
		p := events.Placement{Node: node, ID: fmt.Sprintf("sha256:%064x", img), Size: int64(img) << 10, Seq: rev}
		raw, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		s.indexEntry(bus.Entry{Key: events.InventoryKey(p.ID, p.Node), Value: raw, Revision: rev})
	}
	del := func(img int, node string) {
		s.indexEntry(bus.Entry{Key: events.InventoryKey(fmt.Sprintf("sha256:%064x", img), node), Deleted: true})
	}
	// want is the chunk computed from the index alone.
	want := func(after string, chunk int) ([]string, string) {
		var ids []string
		for id := range s.images {
			if id > after {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		if chunk > 0 && len(ids) > chunk {
			return ids[:chunk], ids[chunk-1]
		}
		return ids, ""
	}
	check := func(after string, chunk int) string {
		t.Helper()
		s.mu.Lock()
		got, next := s.imagesChunk(after, chunk)
		s.mu.Unlock()
		wantIDs, wantNext := want(after, chunk)
		var gotIDs []string
		for _, im := range got {
			gotIDs = append(gotIDs, im.ID)
			var n int
			if _, err := fmt.Sscanf(im.ID, "sha256:%x", &n); err != nil {
				t.Fatal(err)
			}
			if im.Nodes != s.images[im.ID].nodes || im.TotalBytes != int64(im.Nodes)*int64(n)<<10 {
				t.Errorf("image %d: %d nodes, %d bytes; the index has %d nodes", n, im.Nodes, im.TotalBytes, s.images[im.ID].nodes)
			}
		}
		if !slices.Equal(gotIDs, wantIDs) || next != wantNext {
			t.Fatalf("chunk after %q: %d images, next %q; want %d, next %q\ngot  %v\nwant %v", after, len(gotIDs), next, len(wantIDs), wantNext, gotIDs, wantIDs)
		}
		return next
	}
	for img := 1; img <= 25; img++ {
		if img == 14 {
			continue
		}
		put(img, "node-a")
		if img%2 == 0 {
			put(img, "node-b")
		}
	}
	after := check("", 10) // images 1-10
	// Between chunks, only new images and nodes: one before the cursor, one after it within the next
	// chunk, one past it, and a node more for an image after it.
	put(0, "node-c")
	put(14, "node-c")
	put(40, "node-a")
	put(15, "node-c")
	after = check(after, 10) // 11-20
	// Then only images going: one before the cursor, two after it.
	del(3, "node-a")
	del(22, "node-a")
	del(22, "node-b")
	del(24, "node-a")
	after = check(after, 10) // 21, 23, 25, 40: the last chunk
	if after != "" {
		t.Fatalf("the last chunk continues at %q", after)
	}
	if got := check("", 0); got != "" {
		t.Fatalf("a chunk of 0 (all) continues at %q", got)
	}
}
