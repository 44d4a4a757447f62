package fleet

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/imagefleet/imagefleet/events"
)

// Query answers an inventory query from the in-memory index: where reads only the placements of the image
// IDs the query names; images and nodes read the per-image and per-node totals kept with the index. A
// partitioned replica gathers the answer from every replica's part (gather).
func (s *Inventory) Query(ctx context.Context, data []byte) (any, error) {
	var q events.InventoryQuery
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	if q.What == events.InventoryWhere || s.owners != nil {
		if err := q.Validate(); err != nil {
			return nil, fmt.Errorf("%w: %v", events.ErrMalformed, err)
		}
	}
	if s.owners != nil {
		rep, err := s.gather(ctx, q)
		if err != nil {
			return nil, err
		}
		rep.Replica = s.cfg.Replica
		return rep, nil
	}
	var rep events.InventoryReply
	var err error
	switch q.What {
	case events.InventoryWhere:
		ids := s.resolve(q.Image)
		s.mu.RLock()
		rep, err = answer(q, func(yield func(events.Placement)) {
			for _, id := range ids {
				for _, p := range s.index[events.InventoryImageToken(id)] {
					if !p.Gone && p.ID == id {
						yield(p.Placement)
					}
				}
			}
		})
		s.mu.RUnlock()
	case events.InventoryImages:
		s.mu.Lock() // imageTotal may recompute a stale total
		list := make([]events.InventoryImage, 0, len(s.images))
		for id, im := range s.images {
			list = append(list, s.imageTotal(id, im))
		}
		s.mu.Unlock()
		rep, err = pageImages(q, list)
	case events.InventoryNodes:
		s.mu.RLock()
		list := make([]events.InventoryNode, 0, len(s.nodes))
		for _, n := range s.nodes {
			list = append(list, *n)
		}
		s.mu.RUnlock()
		rep, err = pageNodes(q, list)
	default:
		rep, err = answer(q, func(func(events.Placement)) {})
	}
	if err != nil {
		return nil, err
	}
	rep.Replica = s.cfg.Replica
	return rep, nil
}

// resolve turns an image ID, an ID prefix of at least 6 hex digits, a tag or a digest reference into the
// image IDs the index knows by it, sorted. A full ID is kept even if the index does not know it yet.
func (s *Inventory) resolve(image string) []string {
	m := newImageMatcher(image)
	found := map[string]bool{}
	if isFullID(m.raw) {
		found[m.raw] = true
	}
	s.mu.RLock()
	if s.images[m.raw] != nil {
		found[m.raw] = true
	}
	if m.idPrefix != "" {
		for id := range s.images {
			if strings.HasPrefix(id, m.idPrefix) {
				found[id] = true
			}
		}
	}
	for _, r := range []string{m.raw, m.normalized} {
		for id := range s.refs[r] {
			found[id] = true
		}
	}
	s.mu.RUnlock()
	out := make([]string, 0, len(found))
	for id := range found {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}
