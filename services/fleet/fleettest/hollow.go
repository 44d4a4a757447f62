package fleettest

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// HollowFleet is n hollow nodes, each a real gRPC CRI runtime on its own unix socket, with a stand-in GC
// responder per node on one shared bus connection (a "hollow agent": what a thousand agents would answer,
// at the cost of one connection).
type HollowFleet struct {
	Fleet   *hollow.Fleet
	Nodes   []*Node
	Clients []*cri.Client
	images  int
}

// Labels returns hollow node i's labels: zone=z<i mod 4>.
func Labels(i int) map[string]string { return map[string]string{"zone": fmt.Sprintf("z%d", i%4)} }

// StartHollowFleet starts n hollow nodes holding imagesPerNode unused images of 10 MiB each, and serves
// their GC on b until the test ends.
func StartHollowFleet(tb testing.TB, b *bus.Bus, n, imagesPerNode int) *HollowFleet {
	tb.Helper()
	dir, err := os.MkdirTemp("", "hf")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	f, err := hollow.NewFleet(dir, n, nil)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stop, err := f.Start(ctx)
	if err != nil {
		cancel()
		tb.Fatal(err)
	}
	hf := &HollowFleet{Fleet: f, images: imagesPerNode}
	var wg sync.WaitGroup
	tb.Cleanup(func() {
		cancel()
		wg.Wait()
		for _, c := range hf.Clients {
			_ = c.Close()
		}
		stop()
	})
	for i := range n {
		c, err := cri.Dial(cri.Config{Endpoint: f.Endpoint(i), Timeout: 30 * time.Second})
		if err != nil {
			tb.Fatal(err)
		}
		hf.Clients = append(hf.Clients, c)
		nd := &Node{Name: f.Node(i).Name(), RT: c, Bus: b}
		hf.Nodes = append(hf.Nodes, nd)
		wg.Add(1)
		go func() { defer wg.Done(); _ = nd.ServeGC(ctx) }()
	}
	if err := hf.Refill(); err != nil {
		tb.Fatal(err)
	}
	return hf
}

// Refill gives every node its images back (after a real GC removed them).
func (hf *HollowFleet) Refill() error {
	for _, r := range hf.Fleet.Nodes() {
		for j := range hf.images {
			if _, err := r.AddImage(cri.Image{RepoTags: []string{fmt.Sprintf("registry.local/app%d:v1", j)}, Size: 10 << 20}); err != nil {
				return err
			}
		}
	}
	return nil
}

// Names returns the node names in order.
func (hf *HollowFleet) Names() []string {
	out := make([]string, len(hf.Nodes))
	for i, n := range hf.Nodes {
		out[i] = n.Name
	}
	return out
}
