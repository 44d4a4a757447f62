package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/puller"
)

// diskLab is a node on a real disk: a private containerd on a small tmpfs, a loopback registry, and the
// detector, cache, GC executor (default check period) and puller on a real NATS.
type diskLab struct {
	node      string
	reg       *lab.Registry
	ctrd      *lab.Containerd
	b         *bus.Bus
	mount     string
	pause     lab.Pushed
	high, low int
}

func startDiskLab(t testing.TB, node, tmpfs string, high, low int) *diskLab {
	return startDiskLabWith(t, node, tmpfs, high, low, true, 0)
}

// startDiskLabWith starts the lab, with the puller or without (pulls straight over CRI: no pull events).
func startDiskLabWith(t testing.TB, node, tmpfs string, high, low int, withPuller bool, checkPeriod time.Duration) *diskLab {
	t.Helper()
	ctx := t.Context()
	l := &diskLab{node: node, high: high, low: low}
	l.reg = lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	if l.pause, err = lab.Push(ctx, l.reg.Host(), "lab/pause:1", 0, lab.WithBusybox(bb)); err != nil {
		t.Fatal(err)
	}
	l.ctrd = lab.StartContainerd(t, lab.Options{SandboxImage: l.pause.Ref, TmpfsSize: tmpfs})
	cl := l.ctrd.Client()
	if _, err := cl.PullImage(ctx, l.pause.Ref, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	fss, err := cl.ImageFsInfo(ctx)
	if err != nil || len(fss) == 0 {
		t.Fatalf("ImageFsInfo: %v %v", fss, err)
	}
	l.mount = fss[0].Mountpoint
	_, l.b = bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	det, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: log}, cl, l.b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "detector", det.Run)
	bustest.WaitClosed(t, "the detector's first detection", det.Ready())
	ch, err := cache.New(cache.Config{Node: node, Period: time.Hour, Logger: log}, cl, l.b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "cache", ch.Run)
	g, err := gc.New(gc.Config{
		Node: node, Policy: gc.Policy{HighThresholdPercent: high, LowThresholdPercent: low, MinAge: 0},
		PinnedImages: []string{"*/lab/pause:*"}, Period: time.Hour, CheckPeriod: checkPeriod, Registerer: prometheus.NewRegistry(), Logger: log,
	}, gc.Deps{Runtime: cl, Bus: l.b})
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "gc", g.Run)
	if !withPuller {
		return l
	}
	p, err := puller.New(puller.Config{Node: node, ImageGCHighThresholdPercent: high, Registerer: prometheus.NewRegistry(), Logger: log}, cl, l.b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "puller", p.Run)
	return l
}

// pull asks the node's puller for image and returns its terminal result.
func (l *diskLab) pull(t *testing.T, sub *bus.Subscription, ref string) events.PullResult {
	t.Helper()
	id := events.NewID()
	req := events.PullRequest{ID: id, Image: ref, Policy: events.PullIfNotPresent,
		Pod: &events.PodRef{Namespace: "default", Name: "fill", UID: "uid-fill"}}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := puller.Enqueue(ctx, l.b, l.node, req); err != nil {
		t.Fatalf("publish pull: %v", err)
	}
	rctx, rcancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer rcancel()
	for {
		_, data, err := sub.Next(rctx)
		if err != nil {
			t.Fatalf("waiting for the pull of %s: %v", ref, err)
		}
		ev, err := events.DecodeEvent(data)
		if err != nil {
			t.Fatal(err)
		}
		var r events.PullResult
		if err := ev.DecodeData(&r); err != nil {
			t.Fatal(err)
		}
		if r.RequestID == id && ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
			return r
		}
	}
}

func (l *diskLab) listed(t *testing.T) map[string]bool {
	t.Helper()
	var rep events.ImagesReply
	gcRequest(t, l.b, events.QuerySubject(l.node, events.QryImages), events.QueryRequest{}, &rep)
	out := map[string]bool{}
	for _, im := range rep.Images {
		out[im.ID] = true
	}
	return out
}

func (l *diskLab) records(t *testing.T) map[string]bool {
	t.Helper()
	var rep events.RecordsReply
	gcRequest(t, l.b, events.QuerySubject(l.node, events.QryRecords), events.QueryRequest{}, &rep)
	out := map[string]bool{}
	for _, r := range rep.Records {
		out[r.ID] = true
	}
	return out
}

// passes returns the finished GC passes that were not dry runs, in order.
func (l *diskLab) passes(t testing.TB) []events.GCResult {
	t.Helper()
	var out []events.GCResult
	err := l.b.Read(t.Context(), events.EventsStream, events.EventSubject(l.node, events.EntityGC, events.ActionFinished), func(m bus.StreamMsg) error {
		ev, err := events.DecodeEvent(m.Data)
		if err != nil {
			t.Errorf("decode gc.finished: %v", err)
			return bus.StopReading
		}
		var r events.GCResult
		if err := ev.DecodeData(&r); err != nil {
			t.Errorf("decode gc.finished: %v", err)
			return bus.StopReading
		}
		if !r.DryRun {
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// waitIdle waits until a usage check would find nothing to do: usage under the high threshold, and the pass
// that brought it there finished. Usage falls under the threshold part way through a pass (its removals free
// space one image at a time), so it then asks for a dry run at the node's policy: passes run one at a time, so
// its reply comes after the pass in progress has ended.
func (l *diskLab) waitIdle(t *testing.T) {
	t.Helper()
	bustest.Eventually(t, fmt.Sprintf("usage under the high threshold %d%%", l.high), time.Minute, func() error {
		if _, _, usage := gcUsage(t, l.mount); usage >= l.high {
			return fmt.Errorf("usage %d%%", usage)
		}
		return nil
	})
	var r events.GCResult
	gcRequest(t, l.b, events.CommandSubject(l.node, events.VerbGC), events.GCRequest{DryRun: true}, &r)
	if r.UsagePercent >= l.high {
		t.Fatalf("usage %d%% after the pass in progress, at or over the high threshold %d%%", r.UsagePercent, l.high)
	}
}

// TestGCOnARealDiskBetweenPeriods is GC between periods on a real disk, in the lab: images of 10 MiB (about
// 20 MiB on the disk: content plus snapshot) pulled one after another through the puller onto a 128 MiB
// tmpfs, with GC thresholds 60/40 and the 5-minute period out of reach (an hour here). Every pull succeeds:
// GC runs between periods, on the pull.pulled event or before the pull; each pass removes no more images
// than needed to reach the low threshold on the measured filesystem and reports no FreeDiskSpaceFailed;
// records drop the removed images; every pulled image is listed by the images query (from the pull's event:
// the detector's and the cache's periods are an hour); and a dry run and the next pass agree.
func TestGCOnARealDiskBetweenPeriods(t *testing.T) {
	const node = "disk-lab"
	l := startDiskLab(t, node, "128m", 60, 40)
	ctx := t.Context()
	var imgs []lab.Pushed
	for i := range 8 {
		p, err := lab.Push(ctx, l.reg.Host(), fmt.Sprintf("lab/fill-%d:1", i), 10*gcMiB)
		if err != nil {
			t.Fatal(err)
		}
		imgs = append(imgs, p)
	}
	sub, err := l.b.SubscribeSync(ctx, events.EventSubject(node, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)

	capacity, _, _ := gcUsage(t, l.mount)
	target := capacity * int64(100-l.low) / 100
	for i, p := range imgs {
		r := l.pull(t, sub, p.Ref)
		_, _, usage := gcUsage(t, l.mount)
		t.Logf("pull %d (%s): error %q %q, usage now %d%%", i, p.Ref, r.Error, r.Message, usage)
		if r.Error != "" {
			t.Fatalf("pull %d of %s failed: %s: %s", i, p.Ref, r.Error, r.Message)
		}
		bustest.WaitFor(t, p.Ref+" listed by the images query", func() bool { return l.listed(t)[p.ID] })
	}
	l.waitIdle(t)

	passes := l.passes(t)
	var removed []string
	for _, res := range passes {
		ok := res.Succeeded()
		t.Logf("pass (%s): usage %d%%, removed %d (%d failed), declared %d, measured %d, available after %d (target %d), error %q",
			res.Trigger, res.UsagePercent, len(ok), res.FailedCount(), res.FreedBytes, res.MeasuredFreedBytes, res.MeasuredAvailableBytes, target, res.Error)
		if len(ok) == 0 {
			continue
		}
		if res.Error != "" || res.FailedCount() > 0 {
			t.Errorf("pass with removals failed: %q, failed %+v", res.Error, res.Failed)
		}
		if res.MeasuredAvailableBytes < target {
			t.Errorf("pass ended at %d available, under the low threshold's %d", res.MeasuredAvailableBytes, target)
		}
		// No more images than needed: without its last image (each gives back about the same), the pass
		// would have been short of the target.
		perImage := res.MeasuredFreedBytes / int64(len(ok))
		if res.MeasuredAvailableBytes-perImage >= target {
			t.Errorf("pass removed %d images (%d measured, %d each) where %d would have reached the target",
				len(ok), res.MeasuredFreedBytes, perImage, len(ok)-1)
		}
		for _, rm := range ok {
			removed = append(removed, rm.ID)
		}
	}
	if len(removed) == 0 {
		t.Fatal("no GC pass removed anything: the disk never reached the high threshold")
	}
	var warnings []string
	err = l.b.Read(ctx, events.EventsStream, events.EventSubject(node, events.EntityNode, events.ActionWarning), func(m bus.StreamMsg) error {
		warnings = append(warnings, string(m.Data))
		return nil
	})
	if err != nil || len(warnings) != 0 {
		t.Errorf("node warnings %v (%v), want none", warnings, err)
	}
	// Records and the image list follow the removals (from their events: the periods are an hour).
	bustest.Eventually(t, "records and images without the removed images", bustest.Timeout, func() error {
		recs, listed := l.records(t), l.listed(t)
		if slices.ContainsFunc(removed, func(id string) bool { return recs[id] || listed[id] }) {
			return fmt.Errorf("records %v, images %v", recs, listed)
		}
		return nil
	})

	// A dry run and the next pass agree: thresholds that make about two images go.
	cl := l.ctrd.Client()
	waitFsUsedFresh(t, cl, 15*time.Second)
	capacity, available, usage := gcUsage(t, l.mount)
	// One point of slack under the usage read here: containerd's own files share the filesystem and change
	// between this read and the executor's.
	high := usage - 1
	low := 100 - int((available+25*gcMiB)*100/capacity)
	var plan, res events.GCResult
	req := events.GCRequest{DryRun: true, HighThresholdPercent: &high, LowThresholdPercent: &low}
	gcRequest(t, l.b, events.CommandSubject(node, events.VerbGC), req, &plan)
	req.DryRun = false
	gcRequest(t, l.b, events.CommandSubject(node, events.VerbGC), req, &res)
	var planned, done []string
	for _, r := range plan.Succeeded() {
		planned = append(planned, r.ID)
	}
	for _, r := range res.Succeeded() {
		done = append(done, r.ID)
	}
	t.Logf("thresholds %d/%d: dry run %d images, pass %d images (measured %d, available %d), error %q",
		high, low, len(planned), len(done), res.MeasuredFreedBytes, res.MeasuredAvailableBytes, res.Error)
	if len(planned) == 0 || !slices.Equal(planned, done) {
		t.Errorf("dry run planned %v, the pass removed %v: want the same images in the same order", planned, done)
		for _, r := range []events.GCResult{plan, res} {
			t.Logf("dry run %v: usage %d%% (capacity %d, available %d; read here %d%%, %d), skipped %+v",
				r.DryRun, r.UsagePercent, r.CapacityBytes, r.AvailableBytes, usage, available, r.Skipped)
		}
	}
	if res.Error != "" {
		t.Errorf("pass error %q", res.Error)
	}
}

// waitFsUsedFresh waits until containerd's ImageFsInfo usage (its snapshots, refreshed every 10 s) has been
// refreshed since now, so the GC's disk-per-image estimate sees the images pulled last.
func waitFsUsedFresh(t *testing.T, cl interface {
	ImageFsInfo(context.Context) ([]cri.FsInfo, error)
}, limit time.Duration) {
	t.Helper()
	start := time.Now()
	bustest.WaitWithin(t, "containerd's image fs usage refreshed", limit, func() bool {
		fss, err := cl.ImageFsInfo(t.Context())
		if err != nil || len(fss) == 0 {
			t.Fatalf("ImageFsInfo: %v", err)
		}
		return fss[0].Timestamp.After(start)
	})
}

// TestGCKeepsTheRuntimesSandboxImage: containerd 1.6 does not report its sandbox image pinned; with no
// --pinned-images, gc --all-unused keeps it (read from CRI Status verbose info) while a pod's sandbox runs
// it, and removes the other unused images.
func TestGCKeepsTheRuntimesSandboxImage(t *testing.T) {
	const node = "sandbox-lab"
	ctx := t.Context()
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	pause, err := lab.Push(ctx, reg.Host(), "lab/pause:1", 0, lab.WithBusybox(bb))
	if err != nil {
		t.Fatal(err)
	}
	app, err := lab.Push(ctx, reg.Host(), "lab/app:1", gcMiB, lab.WithBusybox(bb))
	if err != nil {
		t.Fatal(err)
	}
	spare, err := lab.Push(ctx, reg.Host(), "lab/spare:1", gcMiB)
	if err != nil {
		t.Fatal(err)
	}
	c := lab.StartContainerd(t, lab.Options{SandboxImage: pause.Ref, TmpfsSize: "96m"})
	cl := c.Client()
	for _, ref := range []string{pause.Ref, app.Ref, spare.Ref} {
		if _, err := cl.PullImage(ctx, ref, nil, nil, nil); err != nil {
			t.Fatalf("pull %s: %v", ref, err)
		}
	}
	if got, err := cl.SandboxImage(ctx); err != nil || got != pause.Ref {
		t.Fatalf("SandboxImage = %q, %v; want %q", got, err, pause.Ref)
	}
	lab.RunPod(t, c, "app", app.Ref)
	images, err := cl.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantWhy := gc.WhySandboxImage
	for _, im := range images {
		if im.ID == pause.ID && im.Pinned {
			t.Logf("containerd reports the sandbox image pinned: the runtime exemption is not what keeps it here")
			wantWhy = gc.WhyPinned
		}
	}

	_, b := bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	det, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: log}, cl, b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "detector", det.Run)
	// The detector's first detection records the images before the pass: one that ran after the pass began
	// would record them first detected after its start, too young even for a minimum age of 0 (the
	// kubelet's rule), and the pass would find nothing eligible.
	bustest.WaitClosed(t, "the detector's first detection", det.Ready())
	g, err := gc.New(gc.Config{Node: node, Policy: gc.Policy{HighThresholdPercent: 85, LowThresholdPercent: 80},
		Period: time.Hour, Registerer: prometheus.NewRegistry(), Logger: log}, gc.Deps{Runtime: cl, Bus: b})
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "gc", g.Run)
	zero := events.Duration{}
	var res events.GCResult
	gcRequest(t, b, events.CommandSubject(node, events.VerbGC), events.GCRequest{AllUnused: true, MinAge: &zero}, &res)
	whys := map[string]string{}
	for _, s := range res.Skipped {
		whys[s.ID] = s.Why
	}
	removed := map[string]bool{}
	for _, r := range res.Succeeded() {
		removed[r.ID] = true
	}
	if whys[pause.ID] != wantWhy {
		t.Errorf("sandbox image kept as %q, want %q", whys[pause.ID], wantWhy)
	}
	if removed[pause.ID] || removed[app.ID] || !removed[spare.ID] {
		t.Errorf("removed %v: want lab/spare:1 only (pause is the sandbox image, app in use)", removed)
	}
	if res.CapacityBytes <= 0 || res.AmountToFree != spare.Size {
		t.Errorf("all-unused result: capacity %d, eligible %d; want the image fs capacity and %d", res.CapacityBytes, res.AmountToFree, spare.Size)
	}
}

// TestPullMakesRoomOnARealDisk: the disk is filled past the high threshold behind the agent's back (pulls
// straight over CRI, no pull events, the usage check an hour away); a pull through the puller then asks for
// a GC pass first (trigger pull) and succeeds; an image larger than the filesystem can hold after GC fails
// at once with a message naming the sizes, not halfway with ENOSPC.
func TestPullMakesRoomOnARealDisk(t *testing.T) {
	const node = "room-lab"
	l := startDiskLabWith(t, node, "128m", 60, 40, true, time.Hour)
	ctx := t.Context()
	cl := l.ctrd.Client()
	for i := 0; ; i++ {
		if _, _, usage := gcUsage(t, l.mount); usage >= l.high {
			break
		}
		if i > 8 {
			t.Fatal("usage never reached the high threshold")
		}
		p, err := lab.Push(ctx, l.reg.Host(), fmt.Sprintf("lab/behind-%d:1", i), 10*gcMiB)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cl.PullImage(ctx, p.Ref, nil, nil, nil); err != nil {
			t.Fatalf("pull %s: %v", p.Ref, err)
		}
	}
	_, _, before := gcUsage(t, l.mount)
	next, err := lab.Push(ctx, l.reg.Host(), "lab/next:1", 10*gcMiB)
	if err != nil {
		t.Fatal(err)
	}
	big, err := lab.Push(ctx, l.reg.Host(), "lab/big:1", 100*gcMiB)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := l.b.SubscribeSync(ctx, events.EventSubject(node, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)

	r := l.pull(t, sub, next.Ref)
	_, _, after := gcUsage(t, l.mount)
	t.Logf("usage %d%% before the pull, %d%% after it: %q %q", before, after, r.Error, r.Message)
	if r.Error != "" {
		t.Fatalf("pull at %d%% usage: %s: %s", before, r.Error, r.Message)
	}
	var pullPass *events.GCResult
	for _, res := range l.passes(t) {
		if res.Trigger == events.GCTriggerPull {
			pullPass = &res
		}
	}
	if pullPass == nil || len(pullPass.Succeeded()) == 0 || pullPass.Error != "" {
		t.Fatalf("no successful GC pass asked by the puller before the pull: %+v", pullPass)
	}

	started := time.Now()
	r = l.pull(t, sub, big.Ref)
	t.Logf("pull of %s (%d bytes) after %v: %q %q", big.Ref, big.Size, time.Since(started), r.Error, r.Message)
	if r.Error != events.ErrKindImagePull || !strings.Contains(r.Message, "no room on the image filesystem: image \""+big.Ref+"\" needs 100.0 MiB") ||
		!strings.Contains(r.Message, "available of 128.0 MiB") {
		t.Fatalf("pull of an image larger than the room: %s %q, want ErrImagePull naming the sizes", r.Error, r.Message)
	}
	if strings.Contains(r.Message, "no space left on device") {
		t.Errorf("the pull reached the disk: %q", r.Message)
	}
}
