package gc

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/distribution/reference"
	"golang.org/x/mod/semver"

	"github.com/imagefleet/imagefleet/events"
)

// keepLast is the node's ImageGCPolicy keepLastTags: per repository, the images of the newest count tags are
// kept.
type keepLast struct {
	count  int
	policy string
}

// why is the reason a pass gives for an image keepLastTags kept.
func (k keepLast) why(repo string) string {
	return fmt.Sprintf("kept: one of the last %d tags of %s (policy %s)", k.count, repo, k.policy)
}

// lastTags returns the images one of whose tags is among the newest count tags of its repository, each with
// that repository (familiar form: "busybox", "registry.example/app"). Every record of the node counts, in use
// or not, so an image in use holds one of the places. The newest tags of a repository are the highest by
// semantic version when every tag of the repository parses as one ("v1.2.3" or "1.2.3"), else those of the
// most recently first-detected images (ties by tag). Untagged images and digests belong to no repository.
func lastTags(recs map[string]events.ImageRecord, count int) map[string]string {
	type tagged struct {
		tag string
		rec *events.ImageRecord
	}
	repos := map[string][]tagged{}
	for id := range recs {
		r := recs[id]
		for _, name := range r.RepoTags {
			named, err := reference.ParseNormalizedNamed(name)
			if err != nil {
				continue
			}
			t, ok := named.(reference.Tagged)
			if !ok {
				continue
			}
			repo := reference.FamiliarName(named)
			repos[repo] = append(repos[repo], tagged{tag: t.Tag(), rec: &r})
		}
	}
	kept := map[string]string{}
	for _, repo := range slices.Sorted(maps.Keys(repos)) {
		tags := repos[repo]
		bySemver := !slices.ContainsFunc(tags, func(t tagged) bool { return !semver.IsValid(semverOf(t.tag)) })
		slices.SortFunc(tags, func(a, b tagged) int {
			if bySemver {
				if c := semver.Compare(semverOf(b.tag), semverOf(a.tag)); c != 0 {
					return c
				}
			} else if c := b.rec.FirstDetected.Compare(a.rec.FirstDetected); c != 0 {
				return c
			}
			return strings.Compare(a.tag, b.tag)
		})
		for _, t := range tags[:min(count, len(tags))] {
			if _, ok := kept[t.rec.ID]; !ok {
				kept[t.rec.ID] = repo
			}
		}
	}
	return kept
}

// semverOf is tag as golang.org/x/mod/semver reads it: with a leading "v".
func semverOf(tag string) string {
	if strings.HasPrefix(tag, "v") {
		return tag
	}
	return "v" + tag
}

// keepLastTags moves the candidates keepLastTags keeps to skipped.
func keepLastTags(cands []candidate, skipped []events.GCSkipped, recs map[string]events.ImageRecord, k *keepLast) ([]candidate, []events.GCSkipped) {
	if k == nil || len(cands) == 0 {
		return cands, skipped
	}
	keep := lastTags(recs, k.count)
	out := cands[:0]
	for _, cd := range cands {
		if repo, ok := keep[cd.ID]; ok {
			skipped = append(skipped, events.GCSkipped{ID: cd.ID, Why: k.why(repo), Policy: k.policy})
			continue
		}
		out = append(out, cd)
	}
	return out, skipped
}
