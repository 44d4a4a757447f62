package gc

import (
	"slices"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// Why a GC pass kept an image (events.GCSkipped.Why).
const (
	WhyInUse          = "in use"                 // a container the runtime lists uses it (or it was used at or after freeTime)
	WhyPinned         = "pinned"                 // the runtime reports it pinned
	WhyPinnedByPolicy = "pinned by policy"       // it matches --pinned-images
	WhyTooYoung       = "too young"              // first detected less than MinAge ago
	WhyInUseAtRemoval = "in use at removal time" // the re-check just before removal found it in use
	WhyNotNeeded      = "not needed"             // enough was freed before reaching it, or usage is below the high threshold
)

// Removal reasons (events.GCRemoved.Reason, events.ImageRemoved.Reason).
const (
	ReasonSpace  = "space"  // freed to bring usage down to the low threshold
	ReasonAge    = "age"    // unused for longer than MaxAge
	ReasonUnused = "unused" // DeleteUnusedImages (--all-unused)
)

// candidate is the kubelet's evictionInfo: an image GC may remove, with its record.
type candidate struct {
	events.ImageRecord
}

// evictionOrder is the kubelet's imagesInEvictionOrder after detection: every record that is not in use,
// not pinned by the runtime and not pinned by policy, sorted by lastUsed ascending (never used first), ties
// by firstDetected ascending (and, where the kubelet leaves the order unspecified, by ID). The excluded
// records are returned as skipped, sorted by ID.
func evictionOrder(recs map[string]events.ImageRecord, pinned *refMatcher) ([]candidate, []events.GCSkipped) {
	cands := make([]candidate, 0, len(recs))
	var skipped []events.GCSkipped
	for _, r := range recs {
		switch {
		case r.InUse:
			skipped = append(skipped, events.GCSkipped{ID: r.ID, Why: WhyInUse})
		case r.Pinned:
			skipped = append(skipped, events.GCSkipped{ID: r.ID, Why: WhyPinned})
		case pinned.match(r):
			skipped = append(skipped, events.GCSkipped{ID: r.ID, Why: WhyPinnedByPolicy})
		default:
			cands = append(cands, candidate{r})
		}
	}
	slices.SortFunc(cands, compareEviction)
	slices.SortFunc(skipped, func(a, b events.GCSkipped) int { return compareStrings(a.ID, b.ID) })
	return cands, skipped
}

// compareEviction is the kubelet's byLastUsedAndDetected with the ID as a last, deterministic tie-break.
func compareEviction(a, b candidate) int {
	if c := compareTime(a.LastUsed, b.LastUsed); c != 0 {
		return c
	}
	if c := compareTime(a.FirstDetected, b.FirstDetected); c != 0 {
		return c
	}
	return compareStrings(a.ID, b.ID)
}

func compareTime(a, b time.Time) int {
	switch {
	case a.Before(b):
		return -1
	case b.Before(a):
		return 1
	}
	return 0
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
