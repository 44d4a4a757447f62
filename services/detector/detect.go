package detector

import (
	"slices"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Changes is what one detection changed.
type Changes struct {
	Added   []events.ImageRecord // new records
	Updated []events.ImageRecord // records whose stored fields changed (lastUsed, size, pinned, tags, inUse)
	Removed []events.ImageRecord // records of images the runtime no longer lists
	InUse   map[string]bool      // the in-use set of this detection
}

// InUseSet is the kubelet's in-use set: the image ID of every container the runtime still lists, running or
// exited (CRI image_id; image_ref for runtimes older than CRI 1.30, which the client already substitutes).
func InUseSet(containers []cri.Container) map[string]bool {
	inUse := make(map[string]bool, len(containers))
	for _, c := range containers {
		if c.ImageID != "" {
			inUse[c.ImageID] = true
		}
	}
	return inUse
}

// Detect applies one detection to records in place, exactly as the kubelet's detectImages: a new image gets
// firstDetected = detectTime; an image in use gets lastUsed = now (the wall clock, not detectTime); size and
// pinned refresh from the listing; records of images no longer listed are dropped. When the listing holds
// the same ID twice, the last entry wins (as the kubelet's map assignment).
func Detect(records map[string]events.ImageRecord, images []cri.Image, containers []cri.Container, detectTime, now time.Time) Changes {
	ch := Changes{InUse: InUseSet(containers)}
	// before holds the records as they were, for the IDs listed now (first sight of each ID wins).
	before := make(map[string]*events.ImageRecord, len(images))
	order := make([]string, 0, len(images))
	for _, im := range images {
		old, known := records[im.ID]
		if _, seen := before[im.ID]; !seen {
			order = append(order, im.ID)
			if known {
				o := old
				before[im.ID] = &o
			} else {
				before[im.ID] = nil
			}
		}
		r := old
		if !known {
			r = events.ImageRecord{ID: im.ID, FirstDetected: detectTime}
		}
		r.InUse = ch.InUse[im.ID]
		if r.InUse {
			r.LastUsed = now
		}
		r.Size, r.Pinned = im.Size, im.Pinned
		r.RepoTags, r.RepoDigests = im.RepoTags, im.RepoDigests
		records[im.ID] = r
	}
	for _, id := range order {
		r := records[id]
		switch old := before[id]; {
		case old == nil:
			ch.Added = append(ch.Added, r)
		case changed(*old, r):
			ch.Updated = append(ch.Updated, r)
		}
	}
	for id, r := range records {
		if _, listed := before[id]; !listed {
			delete(records, id)
			ch.Removed = append(ch.Removed, r)
		}
	}
	return ch
}

func changed(a, b events.ImageRecord) bool {
	return !a.LastUsed.Equal(b.LastUsed) || a.Size != b.Size || a.Pinned != b.Pinned || a.InUse != b.InUse ||
		!slices.Equal(a.RepoTags, b.RepoTags) || !slices.Equal(a.RepoDigests, b.RepoDigests)
}
