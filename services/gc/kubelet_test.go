package gc

// The 23 tests of the kubelet's pkg/kubelet/images/image_gc_manager_test.go (v1.36.3), case by case, with
// the kubelet's names and numbers. The kubelet's detectImages is the detector's Detect (run here by the
// in-memory record source); its imagesInEvictionOrder, freeSpace, freeOldImages, GarbageCollect and
// DeleteUnusedImages are the collector's.

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// 1.
func TestDetectImagesInitialDetect(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048), makeImage(2, 2048))
	h.rt.SetContainers(cri.Container{ID: "container-1", ImageID: imageID(1)}, makeContainer(2))
	start := h.clock.Now()
	h.detect(t, zero)
	if h.recs.Len() != 3 {
		t.Fatalf("records = %d, want 3", h.recs.Len())
	}
	r0, _ := h.recs.Get(imageID(0))
	if !r0.FirstDetected.Equal(zero) || !r0.LastUsed.Equal(zero) {
		t.Errorf("image-0 = %+v, want zero firstDetected and lastUsed", r0)
	}
	for _, i := range []int{1, 2} {
		r, _ := h.recs.Get(imageID(i))
		if !r.FirstDetected.Equal(zero) || r.LastUsed.Before(start) {
			t.Errorf("image-%d = %+v, want firstDetected zero and lastUsed after start", i, r)
		}
	}
}

// 2. The RuntimeClassInImageCriAPI gate is alpha and off by default in v1.36; imagefleet implements the
// gate-off behaviour only: records are keyed by the bare image ID whatever runtime handler pulled the image.
// This test checks that behaviour on the kubelet's set-up (the gate-on keys "image-0,test-runtimeHandler"
// are not produced; see docs/gc.md).
func TestDetectImagesInitialDetectWithRuntimeHandlerInImageCriAPIFeatureGate(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048), makeImage(2, 2048))
	h.rt.SetContainers(makeContainer(1), makeContainer(2))
	start := h.clock.Now()
	h.detect(t, zero)
	if h.recs.Len() != 3 {
		t.Fatalf("records = %d, want 3", h.recs.Len())
	}
	for i, wantUsed := range []bool{false, true, true} {
		r, ok := h.recs.Get(imageID(i))
		if !ok {
			t.Fatalf("no record keyed %q", imageID(i))
		}
		if !r.FirstDetected.Equal(zero) {
			t.Errorf("image-%d firstDetected = %v, want zero", i, r.FirstDetected)
		}
		if used := !r.LastUsed.Before(start); used != wantUsed {
			t.Errorf("image-%d lastUsed = %v, want used=%v", i, r.LastUsed, wantUsed)
		}
	}
}

// 3.
func TestDetectImagesWithNewImage(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	h.detect(t, zero)
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 1024), makeImage(2, 1024))
	detected := zero.Add(time.Second)
	start := h.clock.Now()
	h.detect(t, detected)
	if h.recs.Len() != 3 {
		t.Fatalf("records = %d, want 3", h.recs.Len())
	}
	if r, _ := h.recs.Get(imageID(0)); !r.FirstDetected.Equal(zero) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-0 = %+v", r)
	}
	if r, _ := h.recs.Get(imageID(1)); !r.FirstDetected.Equal(zero) || r.LastUsed.Before(start) {
		t.Errorf("image-1 = %+v", r)
	}
	if r, _ := h.recs.Get(imageID(2)); !r.FirstDetected.Equal(detected) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-2 = %+v, want firstDetected zero+1s", r)
	}
}

// 4.
func TestDeleteUnusedImagesExemptSandboxImage(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(cri.Image{ID: "registry.k8s.io/pause-amd64:latest", Size: 1024, Pinned: true})
	p := h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 1 {
		t.Fatalf("images = %v, want the pinned sandbox image kept", got)
	}
	if why := skippedWhy(p, "registry.k8s.io/pause-amd64:latest"); len(why) != 1 || why[0] != WhyPinned {
		t.Errorf("skipped why = %v, want [pinned]", why)
	}
}

// 5.
func TestDeletePinnedImage(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(
		cri.Image{ID: "registry.k8s.io/pause-amd64:latest", Size: 1024, Pinned: true},
		cri.Image{ID: "registry.k8s.io/pause-amd64:latest", Size: 1024},
	)
	h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 1 {
		t.Fatalf("images = %v, want 1 (one record per ID, the last, unpinned entry wins, removed once)", got)
	}
}

// 6.
func TestDoNotDeletePinnedImage(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(cri.Image{ID: "1", Size: 1024, Pinned: true}, cri.Image{ID: "2", Size: 1024})
	h.getImagesAndFreeSpace(t, 4096, 1024, 1, time.Now())
}

// 7.
func TestDeleteUnPinnedImage(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(cri.Image{ID: "1", Size: 1024}, cri.Image{ID: "2", Size: 1024})
	h.getImagesAndFreeSpace(t, 2048, 2048, 0, time.Now())
}

// 8.
func TestAllPinnedImages(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(cri.Image{ID: "1", Size: 1024, Pinned: true}, cri.Image{ID: "2", Size: 1024, Pinned: true})
	h.getImagesAndFreeSpace(t, 2048, 0, 2, time.Now())
}

// 9.
func TestDetectImagesContainerStopped(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	h.detect(t, zero)
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	r1, _ := h.recs.Get(imageID(1))
	used := r1.LastUsed
	h.rt.SetContainers()
	h.clock.Step(time.Minute)
	h.detect(t, time.Now())
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	if r, _ := h.recs.Get(imageID(0)); !r.FirstDetected.Equal(zero) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-0 = %+v", r)
	}
	if r, _ := h.recs.Get(imageID(1)); !r.FirstDetected.Equal(zero) || !r.LastUsed.Equal(used) {
		t.Errorf("image-1 = %+v, want lastUsed still %v", r, used)
	}
}

// 10.
func TestDetectImagesWithRemovedImages(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	h.detect(t, zero)
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	h.rt.SetImages()
	h.detect(t, time.Now())
	if h.recs.Len() != 0 {
		t.Fatalf("records = %d, want 0", h.recs.Len())
	}
}

// 11.
func TestFreeSpaceImagesInUseContainersAreIgnored(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	p := h.getImagesAndFreeSpace(t, 2048, 1024, 1, time.Now())
	if why := skippedWhy(p, imageID(1)); len(why) != 1 || why[0] != WhyInUse {
		t.Errorf("image-1 skipped = %v, want [in use]", why)
	}
}

// 12.
func TestDeleteUnusedImagesRemoveAllUnusedImages(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048), makeImage(2, 2048))
	h.rt.SetContainers(makeContainer(2))
	p := h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 1 || got[0] != imageID(2) {
		t.Fatalf("images = %v, want [image-2]", got)
	}
	for _, r := range p.res.Removed {
		if r.Reason != ReasonUnused {
			t.Errorf("removed %s reason %q, want unused", r.ID, r.Reason)
		}
	}
	// DeleteUnusedImages counts under "space", as in the kubelet.
	if got := h.metric(ReasonSpace); got != 2 {
		t.Errorf(`kubelet_image_garbage_collected_total{reason="space"} = %v, want 2`, got)
	}
}

// 13. The kubelet sleeps 3 s; the clock is stepped instead.
func TestDeleteUnusedImagesLimitByImageLiveTime(t *testing.T) {
	h := newHarness(t, Policy{MinAge: 3 * time.Second})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048), makeImage(2, 2048))
	h.rt.SetContainers(makeContainer(2))
	h.detect(t, h.clock.Now()) // Start: the first detection
	p := h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 3 {
		t.Fatalf("images = %v, want 3 (not old enough)", got)
	}
	if why := skippedWhy(p, imageID(0)); len(why) != 1 || why[0] != WhyTooYoung {
		t.Errorf("image-0 skipped = %v, want [too young]", why)
	}
	h.clock.Step(3 * time.Second)
	h.deleteUnusedImages(t)
	if got := h.rt.Images(); len(got) != 1 {
		t.Fatalf("images = %v, want 1", got)
	}
}

// 14.
func TestFreeSpaceRemoveByLeastRecentlyUsed(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(0), makeContainer(1))
	h.detect(t, zero)
	h.clock.Step(time.Second)
	h.rt.SetContainers(makeContainer(1))
	h.detect(t, h.clock.Now())
	h.clock.Step(time.Second)
	h.rt.SetContainers()
	h.detect(t, h.clock.Now())
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	h.getImagesAndFreeSpace(t, 1024, 1024, 1, h.clock.Now().Add(time.Minute))
	if got := h.rt.Images(); got[0] != imageID(1) {
		t.Errorf("images = %v, want image-0 (least recently used) removed", got)
	}
}

// 15.
func TestFreeSpaceTiesBrokenByDetectedTime(t *testing.T) {
	h := newHarness(t, Policy{})
	h.rt.SetImages(makeImage(0, 1024))
	h.rt.SetContainers(makeContainer(0))
	h.detect(t, zero)
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.clock.Step(time.Second)
	h.detect(t, h.clock.Now())
	h.rt.SetContainers()
	h.detect(t, h.clock.Now())
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	h.getImagesAndFreeSpace(t, 1024, 2048, 1, h.clock.Now())
	if got := h.rt.Images(); got[0] != imageID(0) {
		t.Errorf("images = %v, want image-1 (never used) removed first", got)
	}
}

// 16.
func TestGarbageCollectBelowLowThreshold(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80})
	h.capacity, h.available = 1000, 600
	p, err := h.garbageCollect(t.Context(), h.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	if p.res.UsagePercent != 40 || p.res.AmountToFree != 0 || len(p.res.Removed) != 0 {
		t.Errorf("result = %+v, want usage 40 and nothing to free", p.res)
	}
}

// 17.
func TestGarbageCollectCadvisorFailure(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80})
	h.statfsErr = errors.New("statfs failed")
	if _, err := h.garbageCollect(t.Context(), h.clock.Now()); err == nil || !strings.Contains(err.Error(), "statfs failed") {
		t.Fatalf("err = %v, want the image fs stats error", err)
	}
	h.statfsErr = nil
	h.rt.FailImageFs(errors.New("image fs info failed"))
	if _, err := h.garbageCollect(t.Context(), h.clock.Now()); err == nil || !strings.Contains(err.Error(), "image fs info failed") {
		t.Fatalf("err = %v, want the ImageFsInfo error", err)
	}
}

// 18.
func TestGarbageCollectBelowSuccess(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80})
	h.capacity, h.available = 1000, 50
	h.rt.SetImages(makeImage(0, 450))
	p, err := h.garbageCollect(t.Context(), h.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	if p.res.UsagePercent != 95 || p.res.AmountToFree != 150 || p.res.FreedBytes != 450 {
		t.Errorf("usage %d amountToFree %d freed %d, want 95, 150, 450", p.res.UsagePercent, p.res.AmountToFree, p.res.FreedBytes)
	}
}

// 19.
func TestGarbageCollectNotEnoughFreed(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, withBus(t))
	h.capacity, h.available = 10737418240, 536870912
	h.rt.SetImages(makeImage(0, 524288000))
	p, err := h.garbageCollect(t.Context(), h.clock.Now())
	const want = "Insufficient free disk space on the node's image filesystem (95% of 10.0 GiB used). " +
		"Failed to free sufficient space by deleting unused images (freed 524288000 bytes). " +
		"Investigate disk usage, as it could be used by active images, logs, volumes, or other data."
	if err == nil || err.Error() != want {
		t.Fatalf("err = %v, want %q", err, want)
	}
	if p.res.AmountToFree != 1610612736 || p.res.UsagePercent != 95 {
		t.Errorf("amountToFree %d usage %d, want 1610612736 and 95", p.res.AmountToFree, p.res.UsagePercent)
	}
	warnings := eventsOfType(streamEvents(t, h.bus), events.EntityNode, events.ActionWarning)
	if len(warnings) != 1 {
		t.Fatalf("node warnings = %d, want 1", len(warnings))
	}
	ev := warnings[0]
	if got := ev.Severity + " " + ev.Reason + " " + ev.Message; got != "Warning FreeDiskSpaceFailed "+want {
		t.Errorf("event = %q", got)
	}
	if ev.Object == nil || ev.Object.Kind != "Node" || ev.Object.Name != testNode {
		t.Errorf("event object = %+v, want the node", ev.Object)
	}
}

// 20.
func TestGarbageCollectImageNotOldEnough(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MinAge: time.Minute})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	h.detect(t, h.clock.Now())
	if h.recs.Len() != 2 {
		t.Fatalf("records = %d, want 2", h.recs.Len())
	}
	h.getImagesAndFreeSpace(t, 1024, 0, 2, h.clock.Now())
	h.clock.Step(time.Minute)
	h.getImagesAndFreeSpace(t, 1024, 1024, 1, h.clock.Now())
}

// 21.
func TestGarbageCollectImageTooOld(t *testing.T) {
	policy := Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MinAge: 0, MaxAge: time.Minute}
	h := newHarness(t, policy)
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	images := h.imagesInEvictionOrder(t, h.clock.Now())
	if len(images) != 1 {
		t.Fatalf("candidates = %d, want 1", len(images))
	}
	// Simulate a pod having just used this image.
	images[0].LastUsed = h.clock.Now()
	oldStartTime := h.clock.Now()
	images, err := h.c.freeOldImages(t.Context(), h.pass(false), images, oldStartTime, oldStartTime)
	if err != nil || len(images) != 1 || len(h.rt.Images()) != 2 {
		t.Fatalf("first round: err %v, remaining %d, runtime %v; want nil, 1, 2 images", err, len(images), h.rt.Images())
	}
	h.clock.Step(policy.MaxAge + 1)
	images, err = h.c.freeOldImages(t.Context(), h.pass(false), images, h.clock.Now(), oldStartTime)
	if err != nil || len(images) != 0 || len(h.rt.Images()) != 1 {
		t.Fatalf("second round: err %v, remaining %d, runtime %v; want nil, 0, 1 image", err, len(images), h.rt.Images())
	}
	if got := h.metric(ReasonAge); got != 1 {
		t.Errorf(`kubelet_image_garbage_collected_total{reason="age"} = %v, want 1`, got)
	}
}

// 22.
func TestGarbageCollectImageMaxAgeDisabled(t *testing.T) {
	h := newHarness(t, Policy{HighThresholdPercent: 90, LowThresholdPercent: 80, MinAge: 0, MaxAge: 0})
	h.rt.SetImages(makeImage(0, 1024), makeImage(1, 2048))
	h.rt.SetContainers(makeContainer(1))
	images := h.imagesInEvictionOrder(t, h.clock.Now())
	if len(images) != 1 || len(h.rt.Images()) != 2 {
		t.Fatalf("candidates = %d, runtime %v", len(images), h.rt.Images())
	}
	images[0].LastUsed = h.clock.Now()
	oldStartTime := h.clock.Now()
	images, err := h.c.freeOldImages(t.Context(), h.pass(false), images, oldStartTime, oldStartTime)
	if err != nil || len(images) != 1 || len(h.rt.Images()) != 2 {
		t.Fatalf("first round: err %v, remaining %d, runtime %v", err, len(images), h.rt.Images())
	}
	h.clock.Set(time.Unix(math.MaxInt64-62135596801, 999999999)) // the maximum representable time
	images, err = h.c.freeOldImages(t.Context(), h.pass(false), images, h.clock.Now(), oldStartTime)
	if err != nil || len(images) != 1 || len(h.rt.Images()) != 2 {
		t.Fatalf("second round: err %v, remaining %d, runtime %v; want nothing removed", err, len(images), h.rt.Images())
	}
}

// 23.
func TestValidateImageGCPolicy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		policy  Policy
		wantErr string
	}{
		{"valid", Policy{HighThresholdPercent: 2, LowThresholdPercent: 1}, ""},
		{"high below 0", Policy{HighThresholdPercent: -1}, "invalid HighThresholdPercent -1, must be in range [0-100]"},
		{"high above 100", Policy{HighThresholdPercent: 101}, "invalid HighThresholdPercent 101, must be in range [0-100]"},
		{"low below 0", Policy{LowThresholdPercent: -1}, "invalid LowThresholdPercent -1, must be in range [0-100]"},
		{"low above 100", Policy{LowThresholdPercent: 101}, "invalid LowThresholdPercent 101, must be in range [0-100]"},
		{"low above high", Policy{HighThresholdPercent: 1, LowThresholdPercent: 2}, "LowThresholdPercent 2 can not be higher than HighThresholdPercent 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.policy.Validate()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("err = %v, want nil", err)
				}
				return
			}
			if err == nil || err.Error() != tc.wantErr {
				t.Fatalf("err = %v, want %q", err, tc.wantErr)
			}
		})
	}
}
