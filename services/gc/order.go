package gc

import (
	"cmp"
	"slices"
	"strings"

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
	WhySandboxImage   = "sandbox image"          // the runtime's pod sandbox (pause) image (CRI Status verbose info)
)

// Removal reasons (events.GCRemoved.Reason, events.ImageRemoved.Reason).
const (
	ReasonSpace  = "space"  // freed to bring usage down to the low threshold
	ReasonAge    = "age"    // unused for longer than MaxAge
	ReasonUnused = "unused" // DeleteUnusedImages (--all-unused)
	ReasonNamed  = "named"  // named by the request (GCRequest.Images: an ImageGC's spec.images)
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
	all := make([]candidate, 0, len(recs))
	keys := make([]evictionKey, 0, len(recs))
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
			keys = append(keys, evictionKey{
				lastSec: r.LastUsed.Unix(), lastNsec: int32(r.LastUsed.Nanosecond()),
				firstSec: r.FirstDetected.Unix(), firstNsec: int32(r.FirstDetected.Nanosecond()),
				i: int32(len(all)),
			})
			all = append(all, candidate{r})
		}
	}
	// Sort small keys, not records: a record is ten times the size of its key.
	slices.SortFunc(keys, func(a, b evictionKey) int {
		if c := cmp.Compare(a.lastSec, b.lastSec); c != 0 {
			return c
		}
		if c := cmp.Compare(a.lastNsec, b.lastNsec); c != 0 {
			return c
		}
		if c := cmp.Compare(a.firstSec, b.firstSec); c != 0 {
			return c
		}
		if c := cmp.Compare(a.firstNsec, b.firstNsec); c != 0 {
			return c
		}
		return strings.Compare(all[a.i].ID, all[b.i].ID)
	})
	// Put the candidates in key order in place: position j takes all[keys[j].i] (cycle by cycle).
	for start := range keys {
		if keys[start].i < 0 {
			continue
		}
		tmp := all[start]
		j := start
		for {
			k := int(keys[j].i)
			keys[j].i = -1
			if k == start {
				all[j] = tmp
				break
			}
			all[j] = all[k]
			j = k
		}
	}
	slices.SortFunc(skipped, func(a, b events.GCSkipped) int { return strings.Compare(a.ID, b.ID) })
	return all, skipped
}

// evictionKey is the sort key of one candidate: lastUsed, firstDetected (as seconds and nanoseconds, which
// order like time.Time.Compare for every time, the zero time included), and its index.
type evictionKey struct {
	lastSec, firstSec   int64
	lastNsec, firstNsec int32
	i                   int32
}

// compareEviction is the kubelet's byLastUsedAndDetected with the ID as a last, deterministic tie-break
// (the order evictionOrder produces).
func compareEviction(a, b candidate) int {
	if c := a.LastUsed.Compare(b.LastUsed); c != 0 {
		return c
	}
	if c := a.FirstDetected.Compare(b.FirstDetected); c != 0 {
		return c
	}
	return strings.Compare(a.ID, b.ID)
}
