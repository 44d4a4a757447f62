package fleet

import (
	"context"
	"fmt"
	"slices"
	"sort"

	"github.com/imagefleet/imagefleet/events"
)

// Part answers a query on events.InventoryPartsSubject from the partitions this replica has ready and
// holds a valid lease on.
func (s *Inventory) Part(_ context.Context, data []byte) (any, error) {
	var pq events.InventoryPartQuery
	if err := events.DecodeStrict(data, &pq); err != nil {
		return nil, err
	}
	q := pq.Query
	if err := q.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", events.ErrMalformed, err)
	}
	if pq.Chunk < 0 {
		return nil, fmt.Errorf("%w: chunk %d must not be negative", events.ErrMalformed, pq.Chunk)
	}
	var resolved []string
	if pq.Resolve {
		resolved = s.resolve(q.Image)
	}
	s.mu.Lock() // imageTotal may recompute a stale total
	defer s.mu.Unlock()
	part := events.InventoryPart{Replica: s.cfg.Replica}
	var answered [events.InventoryPartitions]bool
	var partial bool // a partition indexed but not answered for: its placements are left out
	part.Partitions, answered, partial = s.answered()
	in := func(node string) bool { return !partial || answered[events.InventoryPartition(node)] }
	var err error
	switch {
	case pq.Resolve:
		// The IDs this part knows the image by, whether or not it answers for the partitions holding them
		// (a superset is harmless: where yields only placements of answered partitions).
		for _, id := range resolved {
			part.Reply.Images = append(part.Reply.Images, events.InventoryImage{ID: id})
		}
	case q.What == events.InventoryWhere:
		part.Reply, err = answer(q, func(yield func(events.Placement)) {
			for _, id := range pq.IDs {
				for _, p := range s.index[events.InventoryImageToken(id)] {
					if !p.Gone && p.ID == id && in(p.Node) {
						yield(p.Placement)
					}
				}
			}
		})
	case q.What == events.InventoryImages && !partial:
		part.Reply.Images, part.Reply.Continue = s.imagesChunk(pq.After, pq.Chunk)
	case q.What == events.InventoryImages:
		part.Reply.Images, part.Reply.Continue, err = s.partialImagesChunk(pq.After, pq.Chunk, in)
	case q.What == events.InventoryNodes:
		list := make([]events.InventoryNode, 0, len(s.nodes))
		for _, n := range s.nodes {
			if in(n.Node) {
				list = append(list, *n)
			}
		}
		part.Reply, err = pageNodes(q, list)
	}
	if err != nil {
		return nil, err
	}
	return part, nil
}

// answered returns the partitions this replica answers for (ready, and its lease on them valid), as a list
// and as a set, and whether it holds another partition it does not answer for (partial) (s.mu held).
func (s *Inventory) answered() (parts []int, answered [events.InventoryPartitions]bool, partial bool) {
	for p, st := range s.own {
		switch {
		case st == partReady && s.owners.valid(p):
			parts = append(parts, p)
			answered[p] = true
		case st != partNone:
			partial = true
		}
	}
	return parts, answered, partial
}

// partialImagesChunk is imagesChunk when some partitions are indexed but not answered for: the totals of
// the placements of the answered ones (in), computed from the index (s.mu held).
func (s *Inventory) partialImagesChunk(after string, chunk int, in func(node string) bool) ([]events.InventoryImage, string, error) {
	rep, err := answer(events.InventoryQuery{What: events.InventoryImages}, func(yield func(events.Placement)) {
		for _, nodes := range s.index {
			for _, p := range nodes {
				if !p.Gone && p.ID > after && in(p.Node) {
					yield(p.Placement)
				}
			}
		}
	})
	list := rep.Images
	sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
	cont := ""
	if chunk > 0 && len(list) > chunk {
		list = list[:chunk]
		cont = list[len(list)-1].ID
	}
	return list, cont, err
}

// imagesChunk returns the first chunk (0: all) of the indexed images with IDs after after, in ID order,
// and the last one's ID when more follow (s.mu held).
func (s *Inventory) imagesChunk(after string, chunk int) ([]events.InventoryImage, string) {
	ids := s.sortedImageIDs()
	i, found := slices.BinarySearch(ids, after)
	if found {
		i++
	}
	end, next := len(ids), ""
	if chunk > 0 && end-i > chunk {
		end = i + chunk
		next = ids[end-1]
	}
	list := make([]events.InventoryImage, 0, end-i)
	for _, id := range ids[i:end] {
		list = append(list, s.imageTotal(id, s.images[id]))
	}
	return list, next
}

// sortedImageIDs returns the IDs of the indexed images, sorted, sorting them again only after an image
// came or went (s.mu held).
func (s *Inventory) sortedImageIDs() []string {
	if s.imageIDs == nil {
		ids := make([]string, 0, len(s.images))
		for id := range s.images {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		s.imageIDs = ids
	}
	return s.imageIDs
}
