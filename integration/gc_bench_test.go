package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/gc"
)

// BenchmarkGCRemoval removes 50 images from a real containerd two ways in the same run: one by one with
// CRI RemoveImage (the kubelet's freeSpace), and with the GC executor's DeleteUnusedImages pass (detection
// through the detector over NATS, the in-use re-check before each batch, removals 16 at a time). Both start
// from the same 50 freshly pulled images; pulls are not timed.
func BenchmarkGCRemoval(b *testing.B) {
	const n, parallelism = 50, 16
	ctx := context.Background()
	reg := lab.StartRegistry(b, lab.RegistryOptions{})
	var refs []string
	for i := range n {
		p, err := lab.Push(ctx, reg.Host(), fmt.Sprintf("bench/img-%02d:1", i), 256<<10)
		if err != nil {
			b.Fatal(err)
		}
		refs = append(refs, p.Ref)
	}
	c := lab.StartContainerd(b, lab.Options{TmpfsSize: "128m"})
	cl := c.Client()
	const node = "gc-bench"
	_, bs := bustest.Start(b)
	log := slog.New(slog.DiscardHandler)
	det, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: log}, cl, bs)
	if err != nil {
		b.Fatal(err)
	}
	dctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- det.Run(dctx) }()
	b.Cleanup(func() { stop(); <-done })
	g, err := gc.New(gc.Config{Node: node, Policy: gc.Policy{HighThresholdPercent: 85, LowThresholdPercent: 80},
		RemovalParallelism: parallelism, Registerer: prometheus.NewRegistry(), Logger: log}, gc.Deps{Runtime: cl, Bus: bs})
	if err != nil {
		b.Fatal(err)
	}

	pullAll := func() []string {
		ids := make([]string, len(refs))
		var wg sync.WaitGroup
		sem := make(chan struct{}, 8)
		for i, ref := range refs {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				id, err := cl.PullImage(ctx, ref, nil, nil, nil)
				if err != nil {
					b.Error(err)
				}
				ids[i] = id
			}()
		}
		wg.Wait()
		if b.Failed() {
			b.FailNow()
		}
		return ids
	}
	left := func() int {
		ims, err := cl.ListImages(ctx)
		if err != nil {
			b.Fatal(err)
		}
		return len(ims)
	}
	// The detector must answer before the first timed pass.
	waitDetector(b, bs, node)

	// rawParallel removes ids with plain CRI calls, k at a time: what containerd itself allows, the ceiling
	// the executor is measured against.
	rawParallel := func(ids []string, k int) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		sem := make(chan struct{}, k)
		for _, id := range ids {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				if err := cl.RemoveImage(ctx, id); err != nil {
					b.Error(err)
				}
			}()
		}
		wg.Wait()
		return time.Since(start)
	}
	var serial, parallel, rawSame, raw30 time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		rawSame += rawParallel(pullAll(), parallelism)
		raw30 += rawParallel(pullAll(), 30)
		if l := left(); l != 0 {
			b.Fatalf("%d images left after raw parallel removal", l)
		}
		b.StartTimer()
		b.StopTimer()
		ids := pullAll()
		b.StartTimer()
		start := time.Now()
		for _, id := range ids {
			if err := cl.RemoveImage(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
		serial += time.Since(start)
		b.StopTimer()
		if l := left(); l != 0 {
			b.Fatalf("%d images left after serial removal", l)
		}
		pullAll()
		b.StartTimer()
		start = time.Now()
		res, err := g.GarbageCollect(ctx, events.GCRequest{AllUnused: true, MinAge: &events.Duration{}})
		parallel += time.Since(start)
		b.StopTimer()
		if err != nil {
			b.Fatal(err)
		}
		if len(res.Removed) != n {
			b.Fatalf("executor removed %d images, want %d", len(res.Removed), n)
		}
		if l := left(); l != 0 {
			b.Fatalf("%d images left after the executor's pass", l)
		}
		b.StartTimer()
	}
	b.StopTimer()
	b.ReportMetric(float64(serial.Milliseconds())/float64(b.N), "serial-ms/op")
	b.ReportMetric(float64(parallel.Milliseconds())/float64(b.N), "executor-ms/op")
	b.ReportMetric(float64(serial)/float64(parallel), "speedup")
	b.ReportMetric(float64(serial)/float64(rawSame), "raw-same-parallelism-speedup")
	b.ReportMetric(float64(serial)/float64(raw30), "raw-30-speedup")
}

func waitDetector(b *testing.B, bs interface {
	Request(context.Context, string, any, any) error
}, node string) {
	bustest.Eventually(b, "the detector answering", 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return bs.Request(ctx, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &events.DetectReply{})
	})
}
