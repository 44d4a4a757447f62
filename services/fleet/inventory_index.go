package fleet

import (
	"encoding/json"
	"sort"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// indexEntry applies one bucket change to the index. A node-first key of the previous release is indexed
// under its image-first key and returned for re-keying (ok); a value that is no placement, or whose key is
// neither of its two keys, is ignored.
func (s *Inventory) indexEntry(e bus.Entry) (legacy events.Placement, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.Deleted {
		// Only image-first keys are in the index; a deleted node-first key was re-keyed (its placement is
		// under its image-first key now).
		s.drop(e.Key)
		return legacy, false
	}
	if s.foreignKey(e.Key) {
		return legacy, false
	}
	// This replica's own write comes back from the watch with the revision it was indexed under (wrote):
	// a bucket revision names one write, so it is not decoded again. (A shared-durable replica decodes
	// every other replica's writes: that is what its whole-fleet index costs, docs/benchmarks.md; a
	// partitioned one only those of its partitions, foreignKey.)
	if img, node, found := strings.Cut(e.Key, "."); found && e.Revision > 0 {
		if cur, ok := s.index[img][node]; ok && cur.rev == e.Revision {
			return legacy, false
		}
	}
	var p events.Placement
	if err := json.Unmarshal(e.Value, &p); err != nil || p.Node == "" || p.ID == "" {
		s.drop(e.Key)
		return legacy, false
	}
	return s.indexPlacement(e.Key, p, e.Revision)
}

// indexPlacement indexes p, read from key at revision rev (s.mu held); see indexEntry.
func (s *Inventory) indexPlacement(key string, p events.Placement, rev uint64) (legacy events.Placement, ok bool) {
	switch key {
	case events.InventoryKey(p.ID, p.Node):
	case nodeFirstKey(p):
		ok = true
	default:
		return legacy, false
	}
	if !s.ownsNode(p.Node) {
		return legacy, false
	}
	img, node := events.InventoryImageToken(p.ID), events.NodeToken(p.Node)
	nodes := s.index[img]
	if nodes == nil {
		nodes = map[string]indexed{}
		s.index[img] = nodes
	}
	cur, found := nodes[node]
	if found && cur.Seq > p.Seq {
		return p, ok
	}
	if found {
		s.unref(cur.Placement)
	}
	if ok {
		rev = 0 // the node-first key's revision, not the image-first key's
	}
	if p.Gone {
		nodes[node] = indexed{events.Placement{Node: p.Node, ID: p.ID, Seq: p.Seq, Gone: true}, rev}
		return p, ok
	}
	nodes[node] = indexed{p, rev}
	s.ref(p)
	return p, ok
}

// ref counts a live placement into the references and totals (s.mu held).
func (s *Inventory) ref(p events.Placement) {
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			m := s.refs[r]
			if m == nil {
				m = map[string]int{}
				s.refs[r] = m
			}
			m[p.ID]++
		}
	}
	im := s.images[p.ID]
	if im == nil {
		im = &imageTotals{tags: map[string]int{}, digests: map[string]int{}}
		s.images[p.ID] = im
		s.imageIDs = nil
	}
	im.nodes++
	im.bytes += p.Size
	im.size = max(im.size, p.Size)
	if p.LastUsed.After(im.lastUsed) {
		im.lastUsed = p.LastUsed
	}
	for _, t := range p.RepoTags {
		im.tags[t]++
	}
	for _, d := range p.RepoDigests {
		im.digests[d]++
	}
	n := s.nodes[p.Node]
	if n == nil {
		n = &events.InventoryNode{Node: p.Node}
		s.nodes[p.Node] = n
	}
	n.Images++
	n.TotalBytes += p.Size
}

// drop removes an image-first key's placement from the index (s.mu held).
func (s *Inventory) drop(key string) {
	img, node, _ := strings.Cut(key, ".")
	nodes := s.index[img]
	cur, found := nodes[node]
	if !found {
		return
	}
	s.unref(cur.Placement)
	delete(nodes, node)
	if len(nodes) == 0 {
		delete(s.index, img)
	}
}

// unref takes a live placement out of the ID and reference counts (s.mu held).
func (s *Inventory) unref(p events.Placement) {
	if p.Gone {
		return
	}
	if im := s.images[p.ID]; im != nil {
		im.nodes--
		im.bytes -= p.Size
		im.stale = im.stale || p.Size == im.size || p.LastUsed.Equal(im.lastUsed)
		uncount(im.tags, p.RepoTags)
		uncount(im.digests, p.RepoDigests)
		if im.nodes <= 0 {
			delete(s.images, p.ID)
			s.imageIDs = nil
		}
	}
	if n := s.nodes[p.Node]; n != nil {
		n.Images--
		n.TotalBytes -= p.Size
		if n.Images <= 0 {
			delete(s.nodes, p.Node)
		}
	}
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			if m := s.refs[r]; m != nil {
				if m[p.ID]--; m[p.ID] <= 0 {
					delete(m, p.ID)
				}
				if len(m) == 0 {
					delete(s.refs, r)
				}
			}
		}
	}
}

func uncount(m map[string]int, keys []string) {
	for _, k := range keys {
		if m[k]--; m[k] <= 0 {
			delete(m, k)
		}
	}
}

// imageTotal returns image id's fleet totals, recomputing its largest size and latest use from its
// placements if a removal made them stale (s.mu held for writing).
func (s *Inventory) imageTotal(id string, im *imageTotals) events.InventoryImage {
	if im.stale {
		im.size, im.lastUsed, im.stale = 0, time.Time{}, false
		for _, p := range s.index[events.InventoryImageToken(id)] {
			if !p.Gone && p.ID == id {
				im.size = max(im.size, p.Size)
				if p.LastUsed.After(im.lastUsed) {
					im.lastUsed = p.LastUsed
				}
			}
		}
	}
	return events.InventoryImage{ID: id, RepoTags: sortedKeys(im.tags), RepoDigests: sortedKeys(im.digests), Size: im.size,
		Nodes: im.nodes, TotalBytes: im.bytes, LastUsed: im.lastUsed}
}

func sortedKeys(m map[string]int) []string {
	if len(m) == 0 {
		return nil
	}
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// lookup returns the index's placement of p's image on p's node.
func (s *Inventory) lookup(p events.Placement) (indexed, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	cur, ok := s.index[events.InventoryImageToken(p.ID)][events.NodeToken(p.Node)]
	return cur, ok
}

// wrote indexes what this replica just wrote, so its next apply to the key compares and sets on the new
// revision without waiting for the watch (which brings the same entry again, recognized by its revision).
func (s *Inventory) wrote(key string, p events.Placement, rev uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.indexPlacement(key, p, rev)
}
