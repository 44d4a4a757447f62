package fleet

import (
	"encoding/json"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// BenchmarkInventoryIndexEntry measures what one bucket change costs a replica's index: the work a replica
// does for every placement another replica writes in a partition it indexes (a shared-durable replica keeps
// the whole fleet's index), against decoding the placement alone, the echo of a placement it wrote itself,
// and (foreign) an entry of a partition a partitioned replica does not own. 1,000 nodes x 50 images of the hollow agents' shape (one
// tag, one digest), each key new (a catch-up).
func BenchmarkInventoryIndexEntry(b *testing.B) {
	const nodes, images = 1000, 50
	used := time.Date(2026, 11, 24, 15, 0, 0, 0, time.UTC)
	entries := make([]bus.Entry, 0, nodes*images)
	for n := range nodes {
		for j := range images {
			id := fmt.Sprintf("sha256:%064x", j+1)
			p := events.Placement{Node: fmt.Sprintf("hollow-%05d", n), ID: id,
				RepoTags:    []string{fmt.Sprintf("registry.local/hollow/app%d:v1", j)},
				RepoDigests: []string{fmt.Sprintf("registry.local/hollow/app%d@sha256:%064x", j, j+7)},
				Size:        5 << 20, LastUsed: used, Seq: uint64(n*images + j + 1)}
			raw, err := json.Marshal(p)
			if err != nil {
				b.Fatal(err)
			}
			entries = append(entries, bus.Entry{Key: events.InventoryKey(p.ID, p.Node), Value: raw, Revision: p.Seq})
		}
	}
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			var p events.Placement
			if err := json.Unmarshal(entries[i%len(entries)].Value, &p); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("index", func(b *testing.B) {
		b.ReportAllocs()
		var s *Inventory
		for i := range b.N {
			if i%len(entries) == 0 {
				b.StopTimer()
				s = newInventory(InventoryConfig{})
				b.StartTimer()
			}
			s.indexEntry(entries[i%len(entries)])
		}
	})
	// The echo: a placement this replica wrote (indexed as written), brought back by the watch.
	b.Run("echo", func(b *testing.B) {
		b.ReportAllocs()
		s := newInventory(InventoryConfig{})
		for _, e := range entries {
			var p events.Placement
			if err := json.Unmarshal(e.Value, &p); err != nil {
				b.Fatal(err)
			}
			s.wrote(e.Key, p, e.Revision)
		}
		b.ResetTimer()
		for i := range b.N {
			s.indexEntry(entries[i%len(entries)])
		}
	})
	// A partitioned replica owning half the partitions, shown the other half's entries: a hash of the key.
	b.Run("foreign", func(b *testing.B) {
		b.ReportAllocs()
		s := newInventory(InventoryConfig{Partitioned: true})
		for p := range events.InventoryPartitions / 2 {
			s.own[p] = partReady
		}
		var foreign []bus.Entry
		for _, e := range entries {
			if keyPartition(e.Key) >= events.InventoryPartitions/2 {
				foreign = append(foreign, e)
			}
		}
		b.ResetTimer()
		for i := range b.N {
			s.indexEntry(foreign[i%len(foreign)])
		}
		b.StopTimer()
		if n := len(s.index); n != 0 {
			b.Fatalf("%d images indexed from foreign entries", n)
		}
	})
}

// BenchmarkInventoryPartImages measures one replica's side of a gathered `fleet images` at 50,000 images:
// every chunk of 1,000 in turn (one op: the whole list). chunks cuts each from the sorted IDs, sorted again
// only when an image came or went (chunksAfterChange: before every list); sortEachChunk is the baseline,
// what a part did before: list and sort every image after the cursor for each chunk.
func BenchmarkInventoryPartImages(b *testing.B) {
	const images, chunk = 50000, inventoryImagesChunk
	s := newInventory(InventoryConfig{})
	for j := range images {
		p := events.Placement{Node: fmt.Sprintf("hollow-%05d", j%1000), ID: fmt.Sprintf("sha256:%064x", j+1), Size: 5 << 20, Seq: uint64(j + 1)}
		raw, err := json.Marshal(p)
		if err != nil {
			b.Fatal(err)
		}
		s.indexEntry(bus.Entry{Key: events.InventoryKey(p.ID, p.Node), Value: raw, Revision: p.Seq})
	}
	whole := func(b *testing.B, next func(after string) ([]events.InventoryImage, string)) {
		b.ReportAllocs()
		for range b.N {
			n, after := 0, ""
			for {
				list, more := next(after)
				n += len(list)
				if more == "" {
					break
				}
				after = more
			}
			if n != images {
				b.Fatalf("%d images, want %d", n, images)
			}
		}
	}
	b.Run("chunks", func(b *testing.B) {
		whole(b, func(after string) ([]events.InventoryImage, string) { return s.imagesChunk(after, chunk) })
	})
	// An image came or went since the last query (a live fleet): the IDs are sorted once for the list.
	b.Run("chunksAfterChange", func(b *testing.B) {
		whole(b, func(after string) ([]events.InventoryImage, string) {
			if after == "" {
				s.imageIDs = nil
			}
			return s.imagesChunk(after, chunk)
		})
	})
	b.Run("sortEachChunk", func(b *testing.B) {
		whole(b, func(after string) ([]events.InventoryImage, string) {
			list := make([]events.InventoryImage, 0, len(s.images))
			for id, im := range s.images {
				if id > after {
					list = append(list, s.imageTotal(id, im))
				}
			}
			sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
			if len(list) > chunk {
				list = list[:chunk]
				return list, list[chunk-1].ID
			}
			return list, ""
		})
	})
}
