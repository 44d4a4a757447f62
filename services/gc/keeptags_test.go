package gc

import (
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/services/cri"
)

// TestEvictionOrderKeepsTheLastTags runs the ordering of a pass with keepLastTags 2 over a node with a
// repository of semantic versions (ordered as versions: v1.10.0 is newer than v1.9.0, and "2.0.0" without a
// "v" counts), one of build tags (ordered by first detection), and one that mixes a version with "latest"
// (so by first detection too); an image in use holds one of its repository's places, an untagged image
// belongs to none, an image with tags in two repositories is kept by either.
func TestEvictionOrderKeepsTheLastTags(t *testing.T) {
	h := newHarness(t, DefaultPolicy())
	img := func(id string, tags ...string) cri.Image { return cri.Image{ID: id, RepoTags: tags, Size: 10} }
	// Detected in this order, one minute apart: the later, the newer by first detection.
	order := []cri.Image{
		img("sem-2.0.0", "registry.example/sem:2.0.0"),
		img("sem-1.10.0", "registry.example/sem:v1.10.0"),
		img("sem-1.9.0", "registry.example/sem:v1.9.0"),
		img("sem-1.2.0", "registry.example/sem:v1.2.0"),
		img("build-12", "registry.example/build:build-12"),
		img("build-7", "registry.example/build:build-7"),
		img("build-9", "registry.example/build:build-9"),
		img("mixed-latest", "busybox:latest"),
		img("mixed-1.0.0", "busybox:1.0.0"),
		img("mixed-0.9.0", "busybox:0.9.0"),
		img("untagged"),
		img("two-repos", "registry.example/old:1.0.0", "registry.example/build:build-1"),
		img("old-in-use", "registry.example/old:3.0.0"),
		img("old-2", "registry.example/old:2.0.0"),
	}
	var have []cri.Image
	for _, im := range order {
		have = append(have, im)
		h.rt.SetImages(have...)
		h.detect(t, h.clock.Now())
		h.clock.Step(time.Minute)
	}
	h.rt.SetContainers(cri.Container{ID: "c", ImageID: "old-in-use"})
	recs, err := h.recs.Detect(t.Context(), h.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	p := h.pass(true)
	p.keepLast = &keepLast{count: 2, policy: "recent"}
	cands, skipped := h.c.order(t.Context(), p, recs)

	kept := map[string]string{}
	for _, s := range skipped {
		kept[s.ID] = s.Why
		if s.Why != WhyInUse && s.Policy != "recent" {
			t.Errorf("%s kept without its policy: %+v", s.ID, s)
		}
	}
	want := map[string]string{
		"sem-2.0.0":   "kept: one of the last 2 tags of registry.example/sem (policy recent)",
		"sem-1.10.0":  "kept: one of the last 2 tags of registry.example/sem (policy recent)",
		"build-9":     "kept: one of the last 2 tags of registry.example/build (policy recent)",
		"two-repos":   "kept: one of the last 2 tags of registry.example/build (policy recent)", // build-1, detected after build-9
		"mixed-0.9.0": "kept: one of the last 2 tags of busybox (policy recent)",
		"mixed-1.0.0": "kept: one of the last 2 tags of busybox (policy recent)",
		"old-in-use":  WhyInUse,
		"old-2":       "kept: one of the last 2 tags of registry.example/old (policy recent)",
	}
	for id, why := range want {
		if kept[id] != why {
			t.Errorf("%s: kept %q, want %q", id, kept[id], why)
		}
	}
	var ids []string
	for _, c := range cands {
		ids = append(ids, c.ID)
	}
	slices.Sort(ids)
	if wantIDs := []string{"build-12", "build-7", "mixed-latest", "sem-1.2.0", "sem-1.9.0", "untagged"}; !slices.Equal(ids, wantIDs) {
		t.Errorf("candidates %v, want %v", ids, wantIDs)
	}

	// An image named for removal is not held back by keepLastTags.
	named := h.pass(true)
	named.keepLast = &keepLast{count: 2, policy: "recent"}
	if err := h.c.deleteNamedImages(t.Context(), named, []string{"registry.example/sem:2.0.0"}); err != nil {
		t.Fatal(err)
	}
	if len(named.res.Removed) != 1 || named.res.Removed[0].ID != "sem-2.0.0" || named.res.Removed[0].Reason != ReasonNamed {
		t.Errorf("named removal: %+v", named.res)
	}
}
