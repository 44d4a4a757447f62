package hollow_test

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// withImages returns a runtime holding n images with realistic references.
func withImages(b *testing.B, n int) *hollow.Runtime {
	r := hollow.New(hollow.Options{})
	for i := range n {
		mustAdd(b, r, cri.Image{RepoTags: []string{fmt.Sprintf("registry.example.com/team%d/app%d:v%d", i%50, i, i%7)}})
	}
	return r
}

// unixClient serves r on a unix socket and returns a CRI client on it.
func unixClient(b *testing.B, r *hollow.Runtime) *cri.Client {
	ep, stop, err := r.StartUnix(b.Context(), filepath.Join(b.TempDir(), "cri.sock"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(stop)
	c, err := cri.Dial(cri.Config{Endpoint: ep})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

// BenchmarkListImages lists every image through cri.Client, over the in-process bufconn transport and over a
// unix socket (what a real runtime is reached by).
func BenchmarkListImages(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		for _, transport := range []string{"bufconn", "unix"} {
			b.Run(fmt.Sprintf("images=%d/transport=%s", n, transport), func(b *testing.B) {
				r := withImages(b, n)
				c := dial(b, r)
				if transport == "unix" {
					c = unixClient(b, r)
				}
				ctx := b.Context()
				b.ReportAllocs()
				for b.Loop() {
					imgs, err := c.ListImages(ctx)
					if err != nil || len(imgs) != n {
						b.Fatalf("ListImages = %d, %v", len(imgs), err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/image")
			})
		}
	}
}

// BenchmarkListContainers lists every container (a third of them exited) through cri.Client.
func BenchmarkListContainers(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("containers=%d", n), func(b *testing.B) {
			r := withImages(b, 100)
			imgs := r.Images()
			for i := range n {
				state := cri.ContainerRunning
				if i%3 == 0 {
					state = cri.ContainerExited
				}
				if _, err := r.AddContainer(cri.Container{Name: fmt.Sprint("c", i), ImageID: imgs[i%len(imgs)].ID, State: state,
					Labels: map[string]string{"io.kubernetes.pod.namespace": "default", "io.kubernetes.container.name": fmt.Sprint("c", i)}}); err != nil {
					b.Fatal(err)
				}
			}
			c := dial(b, r)
			ctx := b.Context()
			b.ReportAllocs()
			for b.Loop() {
				cs, err := c.ListContainers(ctx)
				if err != nil || len(cs) != n {
					b.Fatalf("ListContainers = %d, %v", len(cs), err)
				}
			}
		})
	}
}

// BenchmarkPullImage pulls new references from parallel callers: the cost of the runtime's write path.
func BenchmarkPullImage(b *testing.B) {
	r := hollow.New(hollow.Options{})
	c := dial(b, r)
	ctx := b.Context()
	var mu sync.Mutex
	next := 0
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			mu.Lock()
			next++
			ref := fmt.Sprintf("registry.example.com/app%d:v1", next)
			mu.Unlock()
			if _, err := c.PullImage(ctx, ref, nil, nil, nil); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkFleet starts a fleet, dials every node over its unix socket and asks each for its version: the
// start-up cost of a scale test, and the memory and goroutines each node holds while a client is connected.
func BenchmarkFleet(b *testing.B) {
	for _, n := range []int{100, 1000} {
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) {
			var bytesPerNode, goroutinesPerNode float64
			for b.Loop() {
				bytesPerNode, goroutinesPerNode = fleetOnce(b, n)
			}
			b.ReportMetric(bytesPerNode, "B/node")
			b.ReportMetric(goroutinesPerNode, "goroutines/node")
		})
	}
}

func fleetOnce(b *testing.B, n int) (bytesPerNode, goroutinesPerNode float64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	g0 := runtime.NumGoroutine()

	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	f, err := hollow.NewFleet(b.TempDir(), n, nil)
	if err != nil {
		b.Fatal(err)
	}
	stop, err := f.Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	clients := make([]*cri.Client, n)
	for i, ep := range f.Endpoints() {
		if clients[i], err = cri.Dial(cri.Config{Endpoint: ep}); err != nil {
			b.Fatal(err)
		}
		defer clients[i].Close()
		if _, _, err := clients[i].Version(ctx); err != nil {
			b.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	// Both ends live in this process: the figures include the client connections.
	return float64(after.HeapInuse-before.HeapInuse) / float64(n), float64(runtime.NumGoroutine()-g0) / float64(n)
}
