package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// BenchmarkInventoryQueries answers fleet queries over 10,000 nodes x 50 images (500,000 placements written
// with direct KV puts in the image-first layout; image 0 on every node, 499 others on ~982 nodes each) from
// one replica on a real embedded nats-server, the previous release's way and this one's, in the same run:
//
//   - previous-*: what the previous Query did: copy the whole index into a slice, then scan it (Answer);
//   - where-*: this release: resolve the name to IDs, read only those images' placements from the index
//     (kept by image, as the bucket's keys), then page; images-* and nodes-*: the per-image and per-node
//     totals kept up to date with the index, sorted and paged;
//   - bucket-where-*: the same placements as one key-filtered read of the bucket's image-first keys
//     (`-again`: the same read at once, the server's block cache warm), the alternative to an index;
//
// Figures are ms per query through the handler (no NATS round trip), the ratio to the previous way, and
// where-all-chunked: a where of image 0 over NATS as `fleet where` without --limit fetches it (pages of
// 1,000; one unpaged answer, ~3 MB, is over NATS's 1 MiB payload).
func BenchmarkInventoryQueries(b *testing.B) {
	const nodes, perNode, pool = 10000, 50, 500
	srv := bustest.Server(b)
	conn := bustest.Connect(b, srv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inv, err := NewInventory(ctx, InventoryConfig{Replica: "bench"}, conn)
	if err != nil {
		b.Fatal(err)
	}
	id := func(i int) string { return fmt.Sprintf("sha256:%064x", i) }
	now := time.Now().UTC()
	puts := map[string][]byte{}
	flush := func() {
		if err := inv.kv.Batch(ctx, puts, nil); err != nil {
			b.Fatal(err)
		}
		puts = map[string][]byte{}
	}
	seq := uint64(0)
	for n := range nodes {
		node := fmt.Sprintf("hollow-%d", n)
		for j := range perNode {
			img := 0
			if j > 0 {
				img = 1 + (n*(perNode-1)+j-1)%(pool-1)
			}
			seq++
			p := events.Placement{Node: node, ID: id(img), RepoTags: []string{fmt.Sprintf("registry.example/app-%d:v1", img)},
				RepoDigests: []string{fmt.Sprintf("registry.example/app-%d@sha256:%064x", img, img+1<<20)},
				Size:        int64(10<<20 + img), LastUsed: now, Seq: seq}
			raw, _ := json.Marshal(p)
			puts[events.InventoryKey(p.ID, node)] = raw
		}
		if len(puts) >= 2000 {
			flush()
		}
	}
	flush()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heapBefore := ms.HeapInuse
	loadStart := time.Now()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = inv.Run(ctx) }()
	defer wg.Wait()
	defer cancel()
	<-inv.Ready()
	loaded := time.Since(loadStart)
	runtime.GC()
	runtime.ReadMemStats(&ms)
	indexMiB := float64(ms.HeapInuse-min(ms.HeapInuse, heapBefore)) / (1 << 20)

	handler := func(q events.InventoryQuery, want int) func() {
		data, _ := json.Marshal(q)
		return func() {
			out, err := inv.Query(ctx, data)
			if err != nil {
				b.Fatal(err)
			}
			if rep := out.(events.InventoryReply); rep.Total != want {
				b.Fatalf("%+v: total %d, want %d", q, rep.Total, want)
			}
		}
	}
	previous := func(q events.InventoryQuery, want int) func() {
		return func() {
			inv.mu.RLock()
			placements := make([]events.Placement, 0, nodes*perNode)
			for _, nodes := range inv.index {
				for _, p := range nodes {
					if !p.Gone {
						placements = append(placements, p.Placement)
					}
				}
			}
			inv.mu.RUnlock()
			rep, err := Answer(q, placements)
			if err != nil {
				b.Fatal(err)
			}
			if rep.Total != want {
				b.Fatalf("%+v: total %d, want %d", q, rep.Total, want)
			}
		}
	}
	rare := 0
	for n := range nodes { // nodes holding image 7
		for j := 1; j < perNode; j++ {
			if 1+(n*(perNode-1)+j-1)%(pool-1) == 7 {
				rare++
			}
		}
	}
	whereAll := events.InventoryQuery{What: events.InventoryWhere, Image: "registry.example/app-0:v1"}
	wherePage := events.InventoryQuery{What: events.InventoryWhere, Image: "registry.example/app-0:v1", Limit: 100}
	whereRare := events.InventoryQuery{What: events.InventoryWhere, Image: id(7)}
	images := events.InventoryQuery{What: events.InventoryImages, Limit: 50}
	nodesQ := events.InventoryQuery{What: events.InventoryNodes, Limit: 100}
	chunked := func() {
		q := events.InventoryQuery{What: events.InventoryWhere, Image: "registry.example/app-0:v1", Limit: 1000}
		got := 0
		for {
			var rep events.InventoryReply
			if err := conn.Request(ctx, events.InventoryQuerySubject, q, &rep); err != nil {
				b.Fatal(err)
			}
			got += len(rep.Placements)
			if rep.Continue == "" {
				break
			}
			q.Continue = rep.Continue
		}
		if got != nodes {
			b.Fatalf("chunked where: %d placements", got)
		}
	}
	// bucket reads image id's placements from the bucket: one key-filtered read of the image-first keys.
	bucket := func(img int, want int) func() {
		return func() {
			got := 0
			err := inv.kv.Range(ctx, events.InventoryImageKeys(id(img)), func(e bus.Entry) bool {
				var p events.Placement
				if json.Unmarshal(e.Value, &p) == nil && !p.Gone {
					got++
				}
				return true
			})
			if err != nil || got != want {
				b.Fatalf("bucket read of image %d: %d placements, %v", img, got, err)
			}
		}
	}
	ways := []struct {
		name     string
		run      func()
		baseline int // index of the way this one is compared to (-1: none)
	}{
		{"previous-where-all", previous(whereAll, nodes), -1},
		{"where-all", handler(whereAll, nodes), 0},
		{"where-page100", handler(wherePage, nodes), 0},
		{"previous-where-rare", previous(whereRare, rare), -1},
		{"where-rare", handler(whereRare, rare), 3},
		{"previous-images50", previous(images, pool), -1},
		{"images50", handler(images, pool), 5},
		{"previous-nodes100", previous(nodesQ, nodes), -1},
		{"nodes100", handler(nodesQ, nodes), 7},
		{"where-all-chunked", chunked, -1},
		{"bucket-where-all", bucket(0, nodes), 0},
		{"bucket-where-rare", bucket(7, rare), 3},
		{"bucket-where-rare-again", bucket(7, rare), 3},
	}
	took := make([]time.Duration, len(ways))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for w, way := range ways {
			began := time.Now()
			way.run()
			took[w] += time.Since(began)
		}
	}
	b.StopTimer()
	for w, way := range ways {
		b.ReportMetric(float64(took[w].Microseconds())/1000/float64(b.N), way.name+"-ms")
		if way.baseline >= 0 {
			b.ReportMetric(took[w].Seconds()/took[way.baseline].Seconds(), way.name+"-ratio")
		}
	}
	b.ReportMetric(loaded.Seconds(), "index-load-s")
	b.ReportMetric(indexMiB, "index-heap-MiB")
}
