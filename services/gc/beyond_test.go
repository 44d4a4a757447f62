package gc

// Behaviour beyond the kubelet (docs/gc.md): the in-use re-check at removal time, bounded parallel removal
// with the kubelet's serial plan, the space pass after a failed age pass, MaxAge from
// max(lastUsed, firstDetected) with MinAge, "already gone" as success, and the dry run.

import (
	"context"
	"errors"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// racingRecords starts a container (on the runtime) right after detection: a pod starting from an image
// already present while GC runs (kubernetes/kubernetes#123631).
type racingRecords struct {
	h     *harness
	start cri.Container
}

func (r racingRecords) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	recs, err := r.h.recs.Detect(ctx, at)
	r.h.rt.SetContainers(r.start)
	return recs, err
}

func TestInUseAtRemovalTime(t *testing.T) {
	t.Run("container started after detection", func(t *testing.T) {
		h := newHarness(t, Policy{})
		h.rt.SetImages(makeImage(0, 1024), makeImage(1, 1024))
		h.c.records = racingRecords{h: h, start: makeContainer(0)}
		p := h.pass(false)
		if err := h.c.deleteUnusedImages(t.Context(), p); err != nil {
			t.Fatal(err)
		}
		if got := h.rt.Images(); !slices.Equal(got, []string{imageID(0)}) {
			t.Fatalf("images = %v, want image-0 kept", got)
		}
		if why := skippedWhy(p, imageID(0)); !slices.Equal(why, []string{WhyInUseAtRemoval}) {
			t.Errorf("image-0 skipped = %v, want [%s]", why, WhyInUseAtRemoval)
		}
	})
	t.Run("pod index names the image", func(t *testing.T) {
		h := newHarness(t, Policy{}, withBus(t))
		h.rt.SetImages(
			cri.Image{ID: "sha256:" + strings.Repeat("a", 64), RepoTags: []string{"docker.io/library/busybox:latest"}, Size: 10},
			cri.Image{ID: "sha256:" + strings.Repeat("b", 64), RepoTags: []string{"docker.io/library/nginx:1.25"}, Size: 10},
			cri.Image{ID: "sha256:" + strings.Repeat("c", 64), RepoDigests: []string{"quay.io/x/y@sha256:" + strings.Repeat("d", 64)}, Size: 10},
		)
		servePodIndex(t, h, []string{"busybox", "quay.io/x/y@sha256:" + strings.Repeat("d", 64)}, nil)
		p := h.pass(false)
		if err := h.c.deleteUnusedImages(t.Context(), p); err != nil {
			t.Fatal(err)
		}
		if got := removedIDs(p); !slices.Equal(got, []string{"sha256:" + strings.Repeat("b", 64)}) {
			t.Fatalf("removed = %v, want only nginx", got)
		}
		for _, c := range []string{"a", "c"} {
			if why := skippedWhy(p, "sha256:"+strings.Repeat(c, 64)); !slices.Equal(why, []string{WhyInUseAtRemoval}) {
				t.Errorf("%s skipped = %v", c, why)
			}
		}
	})
	t.Run("pod index fails: nothing removed, error reported", func(t *testing.T) {
		h := newHarness(t, Policy{}, withBus(t))
		h.rt.SetImages(makeImage(0, 1024))
		servePodIndex(t, h, nil, errors.New("index not synced"))
		p := h.pass(false)
		err := h.c.deleteUnusedImages(t.Context(), p)
		if err == nil || !strings.Contains(err.Error(), "index not synced") {
			t.Fatalf("err = %v, want the pod index error", err)
		}
		if len(h.rt.Images()) != 1 {
			t.Fatal("image removed although the in-use re-check failed")
		}
	})
	t.Run("no pod index running: check skipped", func(t *testing.T) {
		h := newHarness(t, Policy{}, withBus(t))
		h.rt.SetImages(makeImage(0, 1024))
		h.deleteUnusedImages(t)
		if len(h.rt.Images()) != 0 {
			t.Fatal("image kept although no pod index answers")
		}
	})
}

// servePodIndex answers imagefleet.qry.<node>.inuse until the test ends.
func servePodIndex(t *testing.T, h *harness, images []string, fail error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = h.bus.Serve(ctx, events.QuerySubject(testNode, events.QryInUse), "podindex", func(context.Context, []byte) (any, error) {
			if fail != nil {
				return nil, fail
			}
			return events.InUseReply{Node: testNode, Images: images}, nil
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	// The subscription is live once a request gets an answer.
	bustest.WaitFor(t, "pod index responder", func() bool {
		rctx, c := context.WithTimeout(context.Background(), time.Second)
		defer c()
		_, err := h.bus.RequestRaw(rctx, events.QuerySubject(testNode, events.QryInUse), nil)
		return err == nil
	})
}

func TestParallelRemovalKeepsTheSerialPlan(t *testing.T) {
	// Six unused images of 100 bytes, eviction order image-0..image-5; 300 bytes to free; image-1 fails.
	// The kubelet (one by one): 0 ok, 1 fails, 2 ok, 3 ok -> freed 300, stop. Every parallelism must agree.
	for _, n := range []int{1, 2, 4, 8} {
		t.Run(fmt.Sprintf("parallelism=%d", n), func(t *testing.T) {
			h := newHarness(t, Policy{}, withParallelism(n))
			var imgs []cri.Image
			for i := range 6 {
				imgs = append(imgs, makeImage(i, 100))
			}
			h.rt.SetImages(imgs...)
			for i := range 6 { // distinct detection times give a strict eviction order
				h.rt.SetImages(imgs[:i+1]...)
				h.detect(t, h.clock.Now())
				h.clock.Step(time.Second)
			}
			h.rt.FailRemove(imageID(1), errors.New("boom"))
			cands := h.imagesInEvictionOrder(t, h.clock.Now())
			p := h.pass(false)
			freed, err := h.c.freeSpace(t.Context(), p, 300, h.clock.Now(), cands, ReasonSpace)
			const wantErr = "wanted to free 300 bytes, but freed 300 bytes space with errors in image deletion: boom"
			if err == nil || err.Error() != wantErr {
				t.Fatalf("err = %v, want %q", err, wantErr)
			}
			if freed != 300 {
				t.Errorf("freed = %d, want 300", freed)
			}
			if got := removedIDs(p); !sameSet(got, []string{imageID(0), imageID(2), imageID(3)}) {
				t.Errorf("removed = %v, want image-0, image-2, image-3", got)
			}
			if got := h.rt.Images(); !sameSet(got, []string{imageID(1), imageID(4), imageID(5)}) {
				t.Errorf("left = %v", got)
			}
			for _, id := range []string{imageID(4), imageID(5)} {
				if why := skippedWhy(p, id); !slices.Equal(why, []string{WhyNotNeeded}) {
					t.Errorf("%s skipped = %v, want [not needed]", id, why)
				}
			}
		})
	}
}

func TestRemovalParallelismIsBounded(t *testing.T) {
	h := newHarness(t, Policy{}, withParallelism(4))
	var imgs []cri.Image
	for i := range 10 {
		imgs = append(imgs, makeImage(i, 1))
	}
	h.rt.SetImages(imgs...)
	gate := h.rt.GateRemovals()
	done := make(chan error, 1)
	go func() { done <- h.c.deleteUnusedImages(context.Background(), h.pass(false)) }()
	bustest.WaitFor(t, "4 removals in flight", func() bool { n, _ := h.rt.InFlight(); return n == 4 })
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, most := h.rt.InFlight(); most != 4 {
		t.Errorf("most removals at once = %d, want 4", most)
	}
	if len(h.rt.Images()) != 0 {
		t.Errorf("left = %v", h.rt.Images())
	}
}

func TestFailedAgePassDoesNotSkipSpacePass(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MaxAge: time.Hour})
	beganGC := h.clock.Now()
	h.rt.SetImages(makeImage(0, 100), makeImage(1, 100))
	h.detect(t, h.clock.Now()) // image-0 and image-1 detected now
	h.clock.Step(2 * time.Hour)
	h.rt.SetImages(makeImage(0, 100), makeImage(1, 100), makeImage(2, 200))
	h.detect(t, h.clock.Now()) // image-2 detected two hours later
	h.clock.Step(time.Minute)
	h.rt.FailRemove(imageID(0), errors.New("device busy"))
	// The age pass gives image-1's 100 bytes back (the harness's disk): 50 available, 95 %, when the space
	// pass measures: free 150.
	h.capacity, h.available = 1000, -50

	p, err := h.garbageCollect(t.Context(), beganGC)
	if err == nil || !strings.HasPrefix(err.Error(), "wanted to free images older than 1h0m0s, encountered errors in image deletion: device busy") {
		t.Fatalf("err = %v, want the age pass's error first", err)
	}
	if !strings.Contains(err.Error(), "wanted to free 150 bytes, but freed 200 bytes space") {
		t.Errorf("err = %v, want the space pass's error too", err)
	}
	if got := h.rt.Images(); !slices.Equal(got, []string{imageID(0)}) {
		t.Fatalf("left = %v, want only image-0 (its removal fails)", got)
	}
	reasons := map[string]string{}
	for _, r := range p.res.Removed {
		if r.Error == "" {
			reasons[r.ID] = r.Reason
		}
	}
	if reasons[imageID(1)] != ReasonAge || reasons[imageID(2)] != ReasonSpace {
		t.Errorf("reasons = %v, want image-1 age, image-2 space", reasons)
	}
}

func TestMaxAgeFromLastUsedOrDetection(t *testing.T) {
	for _, tc := range []struct {
		name        string
		policy      Policy
		detectedAgo time.Duration // firstDetected, before freeTime
		usedAgo     time.Duration // lastUsed before freeTime (0: never used)
		wantRemoved bool
	}{
		// The kubelet removes a never-used image as soon as the loop has run MaxAge (W-B); here it is as
		// young as its detection.
		{"fresh pull, never used", Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MaxAge: time.Hour}, time.Minute, 0, false},
		{"never used, detected long ago", Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MaxAge: time.Hour}, 2 * time.Hour, 0, true},
		{"used recently", Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MaxAge: time.Hour}, 3 * time.Hour, 30 * time.Minute, false},
		{"used long ago", Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MaxAge: time.Hour}, 3 * time.Hour, 2 * time.Hour, true},
		{"older than MaxAge, younger than MinAge", Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MinAge: 3 * time.Hour, MaxAge: time.Hour}, 2 * time.Hour, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.policy)
			beganGC := h.clock.Now()
			freeTime := beganGC.Add(10 * time.Hour)
			h.rt.SetImages(makeImage(0, 1))
			if tc.usedAgo > 0 {
				h.rt.SetContainers(makeContainer(0))
				h.clock.Set(freeTime.Add(-tc.usedAgo))
				h.detect(t, freeTime.Add(-tc.detectedAgo))
				h.rt.SetContainers()
			} else {
				h.detect(t, freeTime.Add(-tc.detectedAgo))
			}
			h.clock.Set(freeTime)
			h.capacity, h.available = 100, 100
			p, err := h.garbageCollect(t.Context(), beganGC)
			if err != nil {
				t.Fatal(err)
			}
			if removed := len(h.rt.Images()) == 0; removed != tc.wantRemoved {
				t.Fatalf("removed = %v, want %v (result %+v)", removed, tc.wantRemoved, p.res)
			}
		})
	}
}

func TestAlreadyGoneCountsAsRemoved(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024))
	h.rt.FailRemove(imageID(0), fmt.Errorf("remove image %q: %w", imageID(0), cri.ErrNotFound))
	cands := h.imagesInEvictionOrder(t, h.clock.Now())
	p := h.pass(false)
	freed, err := h.c.freeSpace(t.Context(), p, 1024, h.clock.Now(), cands, ReasonSpace)
	if err != nil || freed != 1024 {
		t.Fatalf("freed %d err %v, want 1024 and no error", freed, err)
	}
	if got := removedIDs(p); !slices.Equal(got, []string{imageID(0)}) {
		t.Errorf("removed = %v", got)
	}
	if got := h.metric(ReasonSpace); got != 1 {
		t.Errorf("metric = %v, want 1", got)
	}
}

func TestDryRunRemovesNothing(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, withBus(t))
	h.rt.SetImages(makeImage(0, 100), makeImage(1, 100), makeImage(2, 100))
	h.rt.SetContainers(makeContainer(2))
	h.capacity, h.available = 1000, 50 // free 150: two images
	h.detect(t, h.clock.Now())
	h.clock.Step(time.Second)
	p := h.pass(true)
	if err := h.c.garbageCollect(t.Context(), p, h.clock.Now()); err != nil {
		t.Fatal(err)
	}
	if got := h.rt.Images(); len(got) != 3 {
		t.Fatalf("images = %v, want all kept", got)
	}
	if slices.ContainsFunc(h.rt.Calls(), func(c string) bool { return strings.HasPrefix(c, "RemoveImage") }) {
		t.Error("RemoveImage called in a dry run")
	}
	if got := removedIDs(p); !sameSet(got, []string{imageID(0), imageID(1)}) || p.res.FreedBytes != 200 {
		t.Errorf("plan removed %v freed %d, want image-0, image-1 and 200", got, p.res.FreedBytes)
	}
	if !p.res.DryRun {
		t.Error("result not marked dry run")
	}
	if got := h.metric(ReasonSpace); got != 0 {
		t.Errorf("metric = %v, want 0", got)
	}
	if evs := streamEvents(t, h.bus); len(evs) != 0 {
		t.Errorf("events = %+v, want none", evs)
	}
}

func TestImageRemovedEventsAndMetric(t *testing.T) {
	h := newHarness(t, Policy{}, withBus(t))
	h.rt.SetImages(makeImage(0, 100), makeImage(1, 200))
	h.deleteUnusedImages(t)
	evs := eventsOfType(streamEvents(t, h.bus), events.EntityImage, events.ActionRemoved)
	if len(evs) != 2 {
		t.Fatalf("image.removed events = %d, want 2", len(evs))
	}
	got := map[string]events.ImageRemoved{}
	for _, ev := range evs {
		var d events.ImageRemoved
		if err := ev.DecodeData(&d); err != nil {
			t.Fatal(err)
		}
		got[d.ID] = d
	}
	if got[imageID(1)].Size != 200 || got[imageID(1)].Reason != ReasonUnused || got[imageID(1)].RepoTags[0] != imageName(1) {
		t.Errorf("image-1 event = %+v", got[imageID(1)])
	}
}

func TestPinnedByPolicy(t *testing.T) {
	h := newHarness(t, Policy{}, withPinned(t, "busybox", "127.0.0.1:5000/pause:*", "*/kube-proxy*", "sha256:"+strings.Repeat("e", 64)))
	h.rt.SetImages(
		cri.Image{ID: "sha256:" + strings.Repeat("1", 64), RepoTags: []string{"docker.io/library/busybox:latest"}},
		cri.Image{ID: "sha256:" + strings.Repeat("2", 64), RepoTags: []string{"127.0.0.1:5000/pause:3.9"}},
		cri.Image{ID: "sha256:" + strings.Repeat("3", 64), RepoTags: []string{"registry.k8s.io/kube-proxy:v1.36.3"}},
		cri.Image{ID: "sha256:" + strings.Repeat("e", 64)},
		cri.Image{ID: "sha256:" + strings.Repeat("4", 64), RepoTags: []string{"docker.io/library/busybox:1.36"}},
	)
	p := h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 4 || slices.Contains(got, "sha256:"+strings.Repeat("4", 64)) {
		t.Fatalf("left = %v, want all but busybox:1.36", got)
	}
	if why := skippedWhy(p, "sha256:"+strings.Repeat("2", 64)); !slices.Equal(why, []string{WhyPinnedByPolicy}) {
		t.Errorf("pause skipped = %v", why)
	}
}

func TestRefMatcher(t *testing.T) {
	digest := "sha256:" + strings.Repeat("d", 64)
	rec := events.ImageRecord{
		ID:          "sha256:" + strings.Repeat("f", 64),
		RepoTags:    []string{"docker.io/library/busybox:latest", "127.0.0.1:5000/pause:3.9"},
		RepoDigests: []string{"docker.io/library/busybox@" + digest},
	}
	for _, tc := range []struct {
		pattern string
		want    bool
	}{
		{"busybox", true},
		{"busybox:latest", true},
		{"docker.io/library/busybox", true},
		{"library/busybox:latest", true},
		{"busybox:1.36", false},
		{"busybox@" + digest, true},
		{"busybox:latest@" + digest, true},
		{"127.0.0.1:5000/pause:*", true},
		{"127.0.0.1:5000/pause:3.8", false},
		{"*/pause*", true},
		{"busy*", true},
		{"nginx*", false},
		{"sha256:" + strings.Repeat("f", 64), true},
		{strings.Repeat("f", 64), true},
		{"sha256:" + strings.Repeat("0", 64), false},
	} {
		t.Run(tc.pattern, func(t *testing.T) {
			m, err := newRefMatcher([]string{tc.pattern}, true)
			if err != nil {
				t.Fatal(err)
			}
			if got := m.match(rec); got != tc.want {
				t.Errorf("match = %v, want %v", got, tc.want)
			}
		})
	}
	if _, err := newRefMatcher([]string{"Not A Ref"}, true); err == nil {
		t.Error("an invalid reference was accepted")
	}
}

// quotaHarness is a node with a 1000-byte quota, 900 used by three images of 300 (image-2 in use, by a
// container), detected a second ago; thresholds 85/80.
func quotaHarness(t *testing.T) *harness {
	t.Helper()
	h := newHarness(t, Policy{HighThresholdPercent: 85, LowThresholdPercent: 80})
	h.c.capacity = 1000
	h.rt.SetImages(makeImage(0, 300), makeImage(1, 300), makeImage(2, 300))
	h.rt.SetContainers(makeContainer(2))
	h.detect(t, h.clock.Now())
	h.clock.Step(time.Second)
	return h
}

// TestDeleteUnusedImagesWithAQuotaListsOnce: with a byte quota, DeleteUnusedImages reports the usage from
// the records it has just detected, as GarbageCollect does, not from a second listing of the runtime (a
// fleet GC's dry run costs each node one CRI call less); a real pass lists once more after its removals,
// to measure what they freed.
func TestDeleteUnusedImagesWithAQuotaListsOnce(t *testing.T) {
	for _, dryRun := range []bool{true, false} {
		t.Run(fmt.Sprintf("dry-run=%v", dryRun), func(t *testing.T) {
			h := quotaHarness(t)
			before := len(h.rt.Calls())
			p := h.pass(dryRun)
			if err := h.c.deleteUnusedImages(t.Context(), p); err != nil {
				t.Fatal(err)
			}
			var lists int
			for _, c := range h.rt.Calls()[before:] {
				if c == "ListImages" {
					lists++
				}
			}
			want := 1 // the detection's
			if !dryRun {
				want = 2 // and the measure after the removals
			}
			if lists != want {
				t.Errorf("ListImages called %d times, want %d: %v", lists, want, h.rt.Calls()[before:])
			}
			// used 900 of 1000 when the pass began.
			if p.res.CapacityBytes != 1000 || p.res.AvailableBytes != 100 || p.res.UsagePercent != 90 || p.res.AmountToFree != 600 {
				t.Errorf("result = %+v", p.res)
			}
			if !dryRun && (p.res.MeasuredAvailableBytes != 700 || p.res.MeasuredFreedBytes != 600) {
				t.Errorf("measured available %d freed %d, want 700 and 600", p.res.MeasuredAvailableBytes, p.res.MeasuredFreedBytes)
			}
		})
	}
}

func TestByteQuota(t *testing.T) {
	h := quotaHarness(t)
	p, err := h.garbageCollect(t.Context(), h.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	// used 900 of 1000: 90 %; free down to 80 %: 1000*20/100 - 100 = 100 -> one image.
	if p.res.CapacityBytes != 1000 || p.res.AvailableBytes != 100 || p.res.UsagePercent != 90 || p.res.AmountToFree != 100 {
		t.Errorf("result = %+v", p.res)
	}
	if got := h.rt.Images(); len(got) != 2 {
		t.Errorf("left = %v, want one image removed", got)
	}
	if slices.Contains(h.rt.Calls(), "ImageFsInfo") {
		t.Error("statfs path used with a byte quota")
	}
}

func TestInvalidDiskCapacity(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, withBus(t))
	h.capacity, h.available = 0, 0
	_, err := h.garbageCollect(t.Context(), h.clock.Now())
	if err == nil || err.Error() != "invalid capacity 0 on image filesystem" {
		t.Fatalf("err = %v", err)
	}
	w := eventsOfType(streamEvents(t, h.bus), events.EntityNode, events.ActionWarning)
	if len(w) != 1 || w[0].Reason != EventInvalidDiskCapacity || w[0].Message != "invalid capacity 0 on image filesystem" || w[0].Severity != events.Warning {
		t.Fatalf("warnings = %+v", w)
	}
}

func TestAvailableClampedToCapacity(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80})
	h.capacity, h.available = 1000, 5000
	p, err := h.garbageCollect(t.Context(), h.clock.Now())
	if err != nil || p.res.AvailableBytes != 1000 || p.res.UsagePercent != 0 {
		t.Fatalf("err %v result %+v, want available clamped to 1000, usage 0", err, p.res)
	}
}

func TestFormatSize(t *testing.T) {
	for in, want := range map[int64]string{
		0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 524288000: "500.0 MiB",
		10737418240: "10.0 GiB", 1 << 40: "1.0 TiB", 3 << 50: "3072.0 TiB",
	} {
		if got := formatSize(in); got != want {
			t.Errorf("formatSize(%d) = %q, want %q", in, got, want)
		}
	}
}

// TestFreeSpaceNothingToFreeStillRemovesOne keeps the kubelet's W-D quirk: with amountToFree <= 0 (low ==
// high, allowed by the policy check) freeSpace still removes one image, as the kubelet's loop breaks only
// after a removal. A failed first removal does not count.
func TestFreeSpaceNothingToFreeStillRemovesOne(t *testing.T) {
	for _, n := range []int{1, 4} {
		t.Run(fmt.Sprintf("parallelism=%d", n), func(t *testing.T) {
			h := newHarness(t, Policy{}, withParallelism(n))
			h.rt.SetImages(makeImage(0, 10), makeImage(1, 10), makeImage(2, 10))
			for i := range 3 {
				h.rt.SetImages(makeImage(0, 10), makeImage(1, 10), makeImage(2, 10))
				h.detect(t, h.clock.Now().Add(time.Duration(i-3)*time.Second))
			}
			h.rt.FailRemove(imageID(0), errors.New("busy"))
			cands := h.imagesInEvictionOrder(t, h.clock.Now())
			p := h.pass(false)
			freed, err := h.c.freeSpace(t.Context(), p, 0, h.clock.Now(), cands, ReasonSpace)
			if err == nil || freed != 10 {
				t.Fatalf("freed %d err %v, want 10 and the error of image-0", freed, err)
			}
			if got := removedIDs(p); len(got) != 1 {
				t.Fatalf("removed %v, want exactly one image", got)
			}
		})
	}
}
