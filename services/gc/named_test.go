package gc

import (
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// TestNamedImagesRemovedWhateverTheirAge: a pass with GCRequest.Images removes every unused image a
// pattern names (a reference, an image ID, a glob), however young and whatever the usage; a matching image in
// use or pinned is kept and reported; an image no pattern names is neither removed nor reported.
func TestNamedImagesRemovedWhateverTheirAge(t *testing.T) {
	h := newHarness(t, Policy{MinAge: time.Hour}, withPinned(t, "image-4-name"))
	h.rt.SetImages(makeImage(0, 10), makeImage(1, 20), makeImage(2, 40), makeImage(3, 80), makeImage(4, 160),
		cri.Image{ID: "sha256:abc", RepoTags: []string{"registry.example/vuln:1.0"}, Size: 320})
	h.rt.SetContainers(makeContainer(3))
	h.detect(t, h.clock.Now()) // every image first detected now: younger than MinAge

	for _, dry := range []bool{true, false} {
		p := h.pass(dry)
		if err := h.c.deleteNamedImages(t.Context(), p, []string{"image-0-name", imageID(1), "registry.example/vuln:*", "image-3-name", "image-4-name"}); err != nil {
			t.Fatal(err)
		}
		var removed, skipped []string
		for _, r := range p.res.Removed {
			if r.Reason != ReasonNamed || r.Error != "" {
				t.Errorf("dry %v: removed %+v", dry, r)
			}
			removed = append(removed, r.ID)
		}
		for _, s := range p.res.Skipped {
			skipped = append(skipped, s.ID+":"+s.Why)
		}
		slices.Sort(removed)
		slices.Sort(skipped)
		if !slices.Equal(removed, []string{imageID(0), imageID(1), "sha256:abc"}) || p.res.AmountToFree != 350 {
			t.Errorf("dry %v: removed %v, amount %d: want image-0, image-1 and the vulnerable one, 350 bytes", dry, removed, p.res.AmountToFree)
		}
		if !slices.Equal(skipped, []string{imageID(3) + ":" + WhyInUse, imageID(4) + ":" + WhyPinnedByPolicy}) {
			t.Errorf("dry %v: skipped %v: want image-3 in use and image-4 pinned, nothing else", dry, skipped)
		}
	}
	left := h.rt.Images()
	slices.Sort(left)
	if !slices.Equal(left, []string{imageID(2), imageID(3), imageID(4)}) {
		t.Errorf("left in the runtime: %v", left)
	}
}

// TestNamedImagesRequest: the request's images are checked, and a named request never shares another pass.
func TestNamedImagesRequest(t *testing.T) {
	for _, c := range []struct {
		req  events.GCRequest
		want string
	}{
		{events.GCRequest{Images: []string{"a b"}}, `gc request image "a b" must be 1-512 characters without spaces`},
		{events.GCRequest{Images: []string{""}}, `gc request image "" must be 1-512 characters without spaces`},
		{events.GCRequest{Images: []string{"x"}, AllUnused: true}, "gc request: images and allUnused exclude each other"},
		{events.GCRequest{Images: make([]string, events.MaxGCImages+1)}, "gc request names 65 images, more than 64"},
		{events.GCRequest{Images: []string{"busybox:1.37", "sha256:abc", "*/nginx:*"}}, ""},
	} {
		err := c.req.Validate()
		if (err == nil) != (c.want == "") || (err != nil && err.Error() != c.want) {
			t.Errorf("%+v: %v, want %q", c.req.Images, err, c.want)
		}
	}
	if shareable(events.GCRequest{Images: []string{"x"}}, events.GCTriggerManual, leaseValue{}) {
		t.Error("a named request shares a pass run with the node's policy")
	}
}
