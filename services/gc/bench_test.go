package gc

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

func benchRecords(n int) map[string]events.ImageRecord {
	rng := rand.New(rand.NewPCG(1, 2))
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	recs := make(map[string]events.ImageRecord, n)
	for i := range n {
		r := events.ImageRecord{
			ID:            fmt.Sprintf("sha256:%064x", i),
			RepoTags:      []string{fmt.Sprintf("registry.example.com/team/app-%d:v1", i)},
			Size:          rng.Int64N(1 << 30),
			FirstDetected: base.Add(time.Duration(rng.IntN(1e6)) * time.Second),
		}
		switch {
		case i%10 == 0:
			r.InUse = true
			r.LastUsed = base.Add(2e6 * time.Second)
		case i%3 == 0: // never used: lastUsed zero, ordered by firstDetected
		default:
			r.LastUsed = base.Add(time.Duration(rng.IntN(1e6)) * time.Second)
		}
		if i%50 == 0 {
			r.Pinned = true
		}
		recs[r.ID] = r
	}
	return recs
}

// BenchmarkEvictionPlan measures the eviction order (filter in use / pinned, sort by lastUsed then
// firstDetected) against a plain sort.Slice of the same records by lastUsed, measured in the same run.
func BenchmarkEvictionPlan(b *testing.B) {
	for _, n := range []int{1000, 10000, 100000} {
		b.Run(fmt.Sprintf("records=%d", n), func(b *testing.B) {
			recs := benchRecords(n)
			pinned, _ := newRefMatcher(nil, true)
			b.ReportAllocs()
			b.ResetTimer()
			// Interleave ours and the baseline so both see the same machine load.
			var ours, baseline time.Duration
			for b.Loop() {
				start := time.Now()
				cands, _ := evictionOrder(recs, pinned)
				ours += time.Since(start)
				if len(cands) == 0 {
					b.Fatal("no candidates")
				}
				b.StopTimer()
				start = time.Now()
				s := make([]events.ImageRecord, 0, len(recs))
				for _, r := range recs {
					s = append(s, r)
				}
				sort.Slice(s, func(i, j int) bool { return s[i].LastUsed.Before(s[j].LastUsed) })
				baseline += time.Since(start)
				b.StartTimer()
			}
			iters := b.N
			b.ReportMetric(float64(ours)/float64(baseline), "x-sort.Slice")
			b.ReportMetric(float64(baseline.Nanoseconds())/float64(iters), "sort.Slice-ns/op")
		})
	}
}

// TestEvictionOrderMatchesComparator checks the key sort against the plain comparator on the bench records.
func TestEvictionOrderMatchesComparator(t *testing.T) {
	recs := benchRecords(5000)
	cands, skipped := evictionOrder(recs, nil)
	if len(cands)+len(skipped) != len(recs) {
		t.Fatalf("candidates %d + skipped %d != records %d", len(cands), len(skipped), len(recs))
	}
	if !sort.SliceIsSorted(cands, func(i, j int) bool { return compareEviction(cands[i], cands[j]) < 0 }) {
		t.Fatal("eviction order is not sorted by lastUsed, firstDetected, ID")
	}
	if cands[0].LastUsed.IsZero() == false {
		t.Fatal("never-used images must come first")
	}
}

// BenchmarkPassLease measures the cost of the node's GC pass lease: a manual pass that removes nothing
// (50 images in use, usage 10 %) under the lease (take over the released value, release with the result: three
// round trips to an embedded nats-server) against the same pass without it, interleaved in the same run.
func BenchmarkPassLease(b *testing.B) {
	srv := bustest.Server(b)
	rt := critest.NewRuntime()
	var ims []cri.Image
	var cs []cri.Container
	for i := range 50 {
		ims = append(ims, makeImage(i, 100))
		cs = append(cs, makeContainer(i))
	}
	rt.SetImages(ims...)
	rt.SetContainers(cs...)
	s, err := New(Config{Node: testNode, Policy: Policy{HighThresholdPercent: 50, LowThresholdPercent: 10},
		Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler)},
		Deps{Runtime: rt, Bus: bustest.Connect(b, srv), Records: gctest.NewRecords(rt, nil),
			Statfs: func(string) (int64, int64, error) { return 10000, 9000, nil }})
	if err != nil {
		b.Fatal(err)
	}
	lease := s.lease
	var ours, baseline time.Duration
	for b.Loop() {
		s.lease = lease
		start := time.Now()
		if _, err := s.GarbageCollect(b.Context(), events.GCRequest{}); err != nil {
			b.Fatal(err)
		}
		ours += time.Since(start)
		b.StopTimer()
		s.lease = nil
		start = time.Now()
		if _, err := s.GarbageCollect(b.Context(), events.GCRequest{}); err != nil {
			b.Fatal(err)
		}
		baseline += time.Since(start)
		b.StartTimer()
	}
	b.ReportMetric(float64(ours)/float64(baseline), "x-unleased")
	b.ReportMetric(float64(baseline.Nanoseconds())/float64(b.N), "unleased-ns/op")
}
