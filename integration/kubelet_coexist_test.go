package integration_test

import (
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/internal/kubeletcfg"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/removals"
)

// TestFirstResponderBesideTheKubelet: a real kubelet v1.37.2 with its image GC on at its defaults (85/80)
// runs on the lab's containerd and 128 MiB image filesystem, next to imagefleet in first-responder mode
// (60/40, usage checked every 200 ms, the puller making room before a pull). The agent's check of the
// kubelet's own configuration finds no fight; eight 10 MiB images (about 20 MiB each on the tmpfs, 160 MiB in
// all, past the kubelet's 85%) are pulled one after another, and the usage, sampled every 50 ms, never
// reaches the kubelet's threshold; imagefleet's GC removed images, and no image vanished that imagefleet did
// not remove.
//
// The kubelet's GC period is 5 minutes and its first pass fails (capacity 0): within this test it cannot act,
// so the test shows that imagefleet keeps usage where the kubelet would never need to, not a race between
// the two removers.
func TestFirstResponderBesideTheKubelet(t *testing.T) {
	const high, low = 60, 40
	l := startDiskLabWith(t, keNode, "128m", high, low, true, 200*time.Millisecond)
	c := kubelab.StartWithKubelet(t, l.ctrd, kubelab.Options{Nodes: []string{keNode}})
	ctx := t.Context()

	k, err := kubeletcfg.Load(filepath.Join(c.Dir(), "kubelet-config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if k.ImageGCHighThresholdPercent != 85 || k.ImageGCLowThresholdPercent != 80 || k.ImageMaximumGCAge != 0 {
		t.Fatalf("the lab's kubelet image GC is not at its defaults: %+v", k)
	}
	ws, err := kubeletcfg.Check(k, kubeletcfg.FirstResponder, kubeletcfg.Ours{HighThresholdPercent: high, LowThresholdPercent: low})
	if err != nil || len(ws) != 0 {
		t.Fatalf("kubelet config check: %v %v, want no fight", ws, err)
	}
	rm, err := removals.New(removals.Config{Node: keNode, Grace: 2 * time.Second, Registerer: prometheus.NewRegistry()}, l.b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "removals", rm.Run)

	var imgs []lab.Pushed
	for i := range 8 {
		p, err := lab.Push(ctx, l.reg.Host(), fmt.Sprintf("lab/kfill-%d:1", i), 10*gcMiB)
		if err != nil {
			t.Fatal(err)
		}
		imgs = append(imgs, p)
	}
	sub, err := l.b.SubscribeSync(ctx, events.EventSubject(keNode, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)

	var maxUsage atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			capacity, available, err := cri.Statfs(l.mount)
			if err != nil || capacity == 0 {
				continue
			}
			u := int64(100 - available*100/capacity)
			for m := maxUsage.Load(); u > m && !maxUsage.CompareAndSwap(m, u); m = maxUsage.Load() {
			}
		}
	}()
	for i, p := range imgs {
		r := l.pull(t, sub, p.Ref)
		_, _, usage := gcUsage(t, l.mount)
		t.Logf("pull %d (%s): error %q, usage now %d%%", i, p.Ref, r.Error, usage)
		for m := maxUsage.Load(); int64(usage) > m && !maxUsage.CompareAndSwap(m, int64(usage)); m = maxUsage.Load() {
		}
		if r.Error != "" {
			t.Fatalf("pull %d of %s failed: %s: %s", i, p.Ref, r.Error, r.Message)
		}
	}
	l.waitIdle(t)
	close(stop)
	wg.Wait()

	removed := 0
	for _, res := range l.passes(t) {
		removed += len(res.Succeeded())
	}
	t.Logf("max usage %d%%, imagefleet removed %d images", maxUsage.Load(), removed)
	if maxUsage.Load() >= int64(k.ImageGCHighThresholdPercent) {
		t.Errorf("usage reached %d%%, the kubelet's imageGCHighThresholdPercent is %d", maxUsage.Load(), k.ImageGCHighThresholdPercent)
	}
	if removed == 0 {
		t.Error("imagefleet removed nothing: the pulls never went past its high threshold")
	}
	// A negative check: the sleep is the removals worker's grace, after which a wrong report would be in
	// the stream; it cannot make the test fail.
	time.Sleep(3 * time.Second)
	err = l.b.Read(ctx, events.EventsStream, events.EventSubject(keNode, events.EntityNode, events.ActionWarning), func(m bus.StreamMsg) error {
		if ev, err := events.DecodeEvent(m.Data); err == nil && ev.Reason == removals.ReasonImageRemovedExternally {
			t.Errorf("another remover at work: %s", ev.Message)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
