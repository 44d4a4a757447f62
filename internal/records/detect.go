package records

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

// Table is the in-memory table of one node's records. Each entry carries the generation of the
// last detection that listed it, so one detection needs a single map lookup per listed image and finds the
// vanished records without a second set.
type Table struct {
	m   map[string]*entry
	gen uint64
}

type entry struct {
	rec events.ImageRecord
	gen uint64
}

// NewTable builds a table from records keyed by image ID.
func NewTable(recs map[string]events.ImageRecord) *Table {
	t := &Table{m: make(map[string]*entry, len(recs))}
	for id, r := range recs {
		t.m[id] = &entry{rec: r}
	}
	return t
}

// Forget deletes the records of ids and returns the IDs that had one.
func (t *Table) Forget(ids []string) []string {
	var gone []string
	for _, id := range ids {
		if _, ok := t.m[id]; ok {
			delete(t.m, id)
			gone = append(gone, id)
		}
	}
	return gone
}

// Len is the number of records.
func (t *Table) Len() int { return len(t.m) }

// Map returns a copy of the records keyed by image ID.
func (t *Table) Map() map[string]events.ImageRecord {
	out := make(map[string]events.ImageRecord, len(t.m))
	for id, e := range t.m {
		out[id] = e.rec
	}
	return out
}

// Detect applies one detection, exactly as the kubelet's detectImages: a new image gets
// firstDetected = detectTime; an image in use gets lastUsed = now (the wall clock, not detectTime); size and
// pinned refresh from the listing; records of images no longer listed are dropped. When the listing holds the
// same ID twice, the last entry wins (as the kubelet's map assignment).
func (t *Table) Detect(images []cri.Image, containers []cri.Container, detectTime, now time.Time) Changes {
	t.gen++
	gen := t.gen
	ch := Changes{InUse: InUseSet(containers)}
	distinct, dups := 0, false
	for _, im := range images {
		e := t.m[im.ID]
		var old events.ImageRecord
		switch {
		case e == nil:
			e = &entry{rec: events.ImageRecord{ID: im.ID, FirstDetected: detectTime}}
			t.m[im.ID] = e
			distinct++
		case e.gen == gen:
			dups = true // listed twice: this entry overwrites the first; the change lists are rebuilt below
		default:
			old = e.rec
			distinct++
		}
		r := &e.rec
		r.InUse = ch.InUse[im.ID]
		if r.InUse {
			r.LastUsed = now
		}
		r.Size, r.Pinned = im.Size, im.Pinned
		r.RepoTags, r.RepoDigests = im.RepoTags, im.RepoDigests
		switch {
		case e.gen == gen:
		case old.ID == "":
			ch.Added = append(ch.Added, e.rec)
		case changed(old, e.rec):
			ch.Updated = append(ch.Updated, e.rec)
		}
		e.gen = gen
	}
	if dups {
		// Rare: refresh the copies in the change lists with the last entry of each ID.
		for i := range ch.Added {
			ch.Added[i] = t.m[ch.Added[i].ID].rec
		}
		for i := range ch.Updated {
			ch.Updated[i] = t.m[ch.Updated[i].ID].rec
		}
	}
	if distinct != len(t.m) {
		for id, e := range t.m {
			if e.gen != gen {
				delete(t.m, id)
				ch.Removed = append(ch.Removed, e.rec)
			}
		}
	}
	return ch
}

// Detect applies one detection to records in place (a map keyed by image ID); see Table.Detect.
func Detect(records map[string]events.ImageRecord, images []cri.Image, containers []cri.Container, detectTime, now time.Time) Changes {
	t := NewTable(records)
	ch := t.Detect(images, containers, detectTime, now)
	clear(records)
	for id, e := range t.m {
		records[id] = e.rec
	}
	return ch
}

func changed(a, b events.ImageRecord) bool {
	return !a.LastUsed.Equal(b.LastUsed) || a.Size != b.Size || a.Pinned != b.Pinned || a.InUse != b.InUse ||
		!slices.Equal(a.RepoTags, b.RepoTags) || !slices.Equal(a.RepoDigests, b.RepoDigests)
}
