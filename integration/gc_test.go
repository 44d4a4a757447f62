package integration_test

import (
	"context"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/gc"
)

const gcMiB = 1 << 20

// gcWorker runs a worker until the test ends (or stop is called) and checks it returns nil (bustest.RunFunc).
type gcWorker struct{ stopFn func() }

func gcStartWorker(t testing.TB, name string, run func(context.Context) error) *gcWorker {
	t.Helper()
	return &gcWorker{stopFn: bustest.RunFunc(t, name, run)}
}

// stop stops the worker now; the name was given at start.
func (w *gcWorker) stop(testing.TB, string) { w.stopFn() }

// gcRequest sends a request, retrying while nobody serves the subject yet.
func gcRequest(t testing.TB, b *bus.Bus, subject string, req, resp any) {
	t.Helper()
	bustest.Eventually(t, "an answer on "+subject, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		return b.Request(ctx, subject, req, resp)
	})
}

func gcUsage(t testing.TB, mountpoint string) (capacity, available int64, percent int) {
	t.Helper()
	capacity, available, err := cri.Statfs(mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	return capacity, available, 100 - int(available*100/capacity)
}

func gcLoadRecords(t *testing.T, b *bus.Bus, node string) map[string]events.ImageRecord {
	t.Helper()
	st, err := records.OpenStore(t.Context(), b, node)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := st.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// TestGCOnRealContainerd is image GC end to end: a private containerd on a small tmpfs, a loopback
// registry, real pulls of sized images, the busybox sandbox image protected by --pinned-images (containerd
// 1.6 does not report it pinned), a real pod keeping one image in use, five images used one after another
// (so their lastUsed differ), the image filesystem over the high threshold for real (statfs of the mountpoint
// ImageFsInfo reports), the detector and GC executor on a real NATS, GC triggered over the bus. Then: usage is
// under the low threshold, the least recently used images went first, the in-use and sandbox images stayed,
// and a restarted detector keeps firstDetected (records in KV).
func TestGCOnRealContainerd(t *testing.T) {
	ctx := t.Context()
	const node = "gc-lab"
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	pause, err := lab.Push(ctx, reg.Host(), "lab/pause:1", 0, lab.WithBusybox(bb))
	if err != nil {
		t.Fatal(err)
	}
	app, err := lab.Push(ctx, reg.Host(), "lab/app:1", 2*gcMiB, lab.WithBusybox(bb))
	if err != nil {
		t.Fatal(err)
	}
	names := []string{"a", "b", "c", "d", "e"}
	sized := map[string]lab.Pushed{}
	for _, n := range names {
		p, err := lab.Push(ctx, reg.Host(), "lab/"+n+":1", 6*gcMiB, lab.WithBusybox(bb))
		if err != nil {
			t.Fatal(err)
		}
		sized[n] = p
	}

	c := lab.StartContainerd(t, lab.Options{SandboxImage: pause.Ref, TmpfsSize: "112m"})
	cl := c.Client()
	for _, ref := range []string{pause.Ref, app.Ref} {
		if _, err := cl.PullImage(ctx, ref, nil, nil, nil); err != nil {
			t.Fatalf("pull %s: %v", ref, err)
		}
	}
	for _, n := range names {
		if _, err := cl.PullImage(ctx, sized[n].Ref, nil, nil, nil); err != nil {
			t.Fatalf("pull %s: %v", sized[n].Ref, err)
		}
	}

	_, b := bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	newDetector := func() *gcWorker {
		d, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: log}, cl, b)
		if err != nil {
			t.Fatal(err)
		}
		return gcStartWorker(t, "detector", d.Run)
	}
	det := newDetector()
	detect := func() {
		t.Helper()
		var rep events.DetectReply
		gcRequest(t, b, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &rep)
	}
	detect() // every image first detected now

	// Use the five sized images one after another, in this order: c is the least recently used, d the most.
	useOrder := []string{"c", "a", "e", "b", "d"}
	for _, n := range useOrder {
		sb, _ := lab.RunPod(t, c, "use-"+n, sized[n].Ref)
		detect() // lastUsed = now
		if err := cl.StopPodSandbox(ctx, sb); err != nil {
			t.Fatal(err)
		}
		if err := cl.RemovePodSandbox(ctx, sb); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // distinct lastUsed; not an assertion
	}
	lab.RunPod(t, c, "app", app.Ref) // keeps lab/app:1 in use
	detect()
	before := gcLoadRecords(t, b, node)
	for i := 1; i < len(useOrder); i++ {
		prev, cur := before[sized[useOrder[i-1]].ID], before[sized[useOrder[i]].ID]
		if !prev.LastUsed.Before(cur.LastUsed) || cur.InUse {
			t.Fatalf("records: %s lastUsed %v, %s lastUsed %v (in use %v): want strictly increasing and unused",
				useOrder[i-1], prev.LastUsed, useOrder[i], cur.LastUsed, cur.InUse)
		}
	}
	if !before[app.ID].InUse {
		t.Fatalf("record of %s not in use: %+v", app.Ref, before[app.ID])
	}

	fss, err := cl.ImageFsInfo(ctx)
	if err != nil || len(fss) == 0 {
		t.Fatalf("ImageFsInfo: %v %v", fss, err)
	}
	mount := fss[0].Mountpoint
	capacity, available, usage := gcUsage(t, mount)
	// Thresholds from the real usage: high = the usage now (so GC runs), low such that about two of the five
	// sized images must go. GC stops on the measured filesystem (docs/gc.md, "Between periods, on a real
	// disk"), where an image takes about 1.4 times its reported size (its random layer twice, compressed
	// content and unpacked snapshot; the busybox layer is shared): twice the reported size is about 1.4
	// images on the disk, so the second image ends the pass well under the low threshold.
	size := sized["a"].Size
	high := usage
	low := 100 - int((available+size*2)*100/capacity)
	t.Logf("image fs %s: capacity %d MiB, available %d MiB, usage %d%%; thresholds high %d low %d", mount,
		capacity/gcMiB, available/gcMiB, usage, high, low)
	if low < 1 || low >= high {
		t.Fatalf("lab image fs too empty for the test: usage %d%%, low %d", usage, low)
	}

	g, err := gc.New(gc.Config{
		Node: node, Policy: gc.Policy{HighThresholdPercent: high, LowThresholdPercent: low, MinAge: 0},
		PinnedImages: []string{"*/lab/pause:*"}, Period: time.Hour, Registerer: prometheus.NewRegistry(), Logger: log,
	}, gc.Deps{Runtime: cl, Bus: b})
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "gc", g.Run)

	var plan events.GCResult
	gcRequest(t, b, events.CommandSubject(node, events.VerbGC), events.GCRequest{DryRun: true}, &plan)
	var res events.GCResult
	gcRequest(t, b, events.CommandSubject(node, events.VerbGC), events.GCRequest{}, &res)
	t.Logf("gc: usage %d%%, amountToFree %d, freed %d, removed %+v, skipped %+v, error %q",
		res.UsagePercent, res.AmountToFree, res.FreedBytes, res.Removed, res.Skipped, res.Error)
	if res.Error != "" {
		t.Fatalf("gc error: %s", res.Error)
	}
	var removed []string
	for _, r := range res.Removed {
		if r.Error != "" || r.Reason != gc.ReasonSpace {
			t.Errorf("removal %+v: want a successful space removal", r)
		}
		removed = append(removed, r.ID)
	}
	var planned []string
	for _, r := range plan.Removed {
		planned = append(planned, r.ID)
	}
	if !slices.Equal(planned, removed) || !plan.DryRun {
		t.Errorf("dry run planned %v, GC removed %v: want the same", planned, removed)
	}

	// The least recently used went first: the removed images are a prefix of useOrder, and not all of it.
	k := len(removed)
	if k == 0 || k >= len(useOrder) {
		t.Fatalf("removed %d images, want between 1 and %d", k, len(useOrder)-1)
	}
	for i, n := range useOrder[:k] {
		if removed[i] != sized[n].ID {
			t.Errorf("removal %d: %s, want lab/%s:1 (%s), the least recently used", i, removed[i], n, sized[n].ID)
		}
	}
	images, err := cl.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, im := range images {
		listed[im.ID] = true
	}
	for i, n := range useOrder {
		if want := i >= k; listed[sized[n].ID] != want {
			t.Errorf("lab/%s:1 listed %v, want %v", n, listed[sized[n].ID], want)
		}
	}
	if !listed[app.ID] || !listed[pause.ID] {
		t.Errorf("in-use image listed %v, pinned sandbox image listed %v: want both kept", listed[app.ID], listed[pause.ID])
	}
	whys := map[string]string{}
	for _, s := range res.Skipped {
		whys[s.ID] = s.Why
	}
	if whys[app.ID] != gc.WhyInUse || whys[pause.ID] != gc.WhyPinnedByPolicy {
		t.Errorf("skipped: app %q, pause %q; want %q and %q", whys[app.ID], whys[pause.ID], gc.WhyInUse, gc.WhyPinnedByPolicy)
	}

	// Usage is under the low threshold (statfs; containerd deletes content and snapshots synchronously).
	_, _, after := gcUsage(t, mount)
	if after >= low {
		t.Errorf("usage after GC %d%%, want under the low threshold %d%%", after, low)
	}
	t.Logf("usage %d%% -> %d%% after removing %d images", usage, after, k)

	removedEvents := 0
	err = b.Read(ctx, events.EventsStream, events.EventSubject(node, events.EntityImage, events.ActionRemoved), func(bus.StreamMsg) error {
		removedEvents++
		return nil
	})
	if err != nil || removedEvents != k {
		t.Errorf("image.removed events %d (%v), want %d", removedEvents, err, k)
	}

	// A restarted detector keeps firstDetected: records come back from KV.
	det.stop(t, "detector")
	newDetector()
	detect()
	afterRestart := gcLoadRecords(t, b, node)
	for _, id := range []string{app.ID, pause.ID, sized["d"].ID} {
		if !afterRestart[id].FirstDetected.Equal(before[id].FirstDetected) {
			t.Errorf("%s firstDetected %v after restart, want %v", id, afterRestart[id].FirstDetected, before[id].FirstDetected)
		}
	}
	if !afterRestart[sized["d"].ID].LastUsed.Equal(before[sized["d"].ID].LastUsed) {
		t.Errorf("lastUsed of lab/d:1 lost on restart")
	}
	for _, n := range useOrder[:k] {
		if _, ok := afterRestart[sized[n].ID]; ok {
			t.Errorf("record of removed lab/%s:1 still there after detection", n)
		}
	}
}
