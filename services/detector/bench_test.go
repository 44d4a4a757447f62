package detector_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/detector"
)

// BenchmarkDetectCycle measures one steady-state detection (records already known, 10 containers keeping
// 10 images in use, so 10 records change per cycle) against the raw ListImages + ListContainers calls it makes
// over the same gRPC connection to a hollow runtime, in the same run. Goal: overhead ratio <= 1.2.
func BenchmarkDetectCycle(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("images=%d", n), func(b *testing.B) {
			rt := hollow.New(hollow.Options{Name: "bench"})
			for i := range n {
				im, err := rt.AddImage(cri.Image{RepoTags: []string{fmt.Sprintf("registry.example/app-%d:v1", i)}, Size: int64(1000 + i)})
				if err != nil {
					b.Fatal(err)
				}
				if i%(n/10) == 0 {
					if _, err := rt.AddContainer(cri.Container{Name: fmt.Sprintf("c%d", i), ImageID: im.ID, State: cri.ContainerRunning}); err != nil {
						b.Fatal(err)
					}
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			endpoint, stop, err := rt.StartUnix(ctx, filepath.Join(b.TempDir(), "cri.sock"))
			if err != nil {
				b.Fatal(err)
			}
			defer stop()
			client, err := cri.Dial(cri.Config{Endpoint: endpoint})
			if err != nil {
				b.Fatal(err)
			}
			defer client.Close()
			_, bb := bustest.Start(b)
			svc, err := detector.New(detector.Config{Node: "bench", Period: time.Hour}, client, bb)
			if err != nil {
				b.Fatal(err)
			}
			if err := svc.Open(ctx); err != nil {
				b.Fatal(err)
			}
			if _, err := svc.Detect(ctx, time.Now()); err != nil { // first detection: every record is new
				b.Fatal(err)
			}
			raw := func() {
				if _, err := client.ListImages(ctx); err != nil {
					b.Fatal(err)
				}
				if _, err := client.ListContainers(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := svc.Detect(ctx, time.Now()); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			// The ratio: raw listings and detect cycles interleaved, round by round, and the medians compared,
			// so load from elsewhere on the machine and GC drift weigh on both alike.
			const rounds = 21
			var raws, detects []time.Duration
			for range rounds {
				t0 := time.Now()
				raw()
				raws = append(raws, time.Since(t0))
				t1 := time.Now()
				if _, err := svc.Detect(ctx, time.Now()); err != nil {
					b.Fatal(err)
				}
				detects = append(detects, time.Since(t1))
			}
			slices.Sort(raws)
			slices.Sort(detects)
			rawPer, detectPer := raws[rounds/2], detects[rounds/2]
			b.ReportMetric(float64(rawPer.Microseconds()), "raw-us/op")
			b.ReportMetric(float64(detectPer.Microseconds()), "detect-us/op")
			b.ReportMetric(float64(detectPer)/float64(rawPer), "ratio-to-raw")
		})
	}
}
