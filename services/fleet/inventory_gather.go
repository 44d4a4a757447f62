package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Gathering waits: a query waits up to inventoryGatherWait in all for parts covering every partition,
// asking again every inventoryGatherRound while some are missing (a takeover makes its partitions
// unanswered until the new owner has read them from the bucket).
const (
	inventoryGatherWait  = 10 * time.Second
	inventoryGatherRound = 2 * time.Second
	// inventoryImagesChunk is how many images one part sends at a time (~400 bytes each as JSON).
	inventoryImagesChunk = 1000
)

// gather asks every partitioned replica for its part of q and merges the parts once they cover every
// partition.
func (s *Inventory) gather(ctx context.Context, q events.InventoryQuery) (events.InventoryReply, error) {
	ctx, cancel := context.WithTimeout(ctx, inventoryGatherWait)
	defer cancel()
	switch q.What {
	case events.InventoryWhere:
		ids := []string{strings.TrimSpace(q.Image)}
		if !isFullID(ids[0]) {
			parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, Resolve: true})
			if err != nil {
				return events.InventoryReply{}, err
			}
			ids = resolvedIDs(parts)
		}
		if len(ids) == 0 {
			return answer(q, func(func(events.Placement)) {})
		}
		parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, IDs: ids})
		if err != nil {
			return events.InventoryReply{}, err
		}
		return mergeParts(q, parts)
	case events.InventoryImages:
		// In chunks by image ID: an image is merged once every part has sent past it, so each round merges
		// the images up to the smallest last ID of the parts that have more.
		byID := map[string]*events.InventoryImage{}
		after := ""
		for {
			parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, After: after, Chunk: inventoryImagesChunk})
			if err != nil {
				return events.InventoryReply{}, err
			}
			bound := ""
			for _, part := range parts {
				if c := part.Reply.Continue; c != "" && (bound == "" || c < bound) {
					bound = c
				}
			}
			mergeImages(byID, parts, bound)
			if bound == "" {
				return pageImages(q, imageList(byID))
			}
			after = bound
		}
	default:
		parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q})
		if err != nil {
			return events.InventoryReply{}, err
		}
		return mergeParts(q, parts)
	}
}

// resolvedIDs joins the IDs of resolve parts, sorted.
func resolvedIDs(parts []events.InventoryPart) []string {
	set := map[string]bool{}
	for _, part := range parts {
		for _, im := range part.Reply.Images {
			set[im.ID] = true
		}
	}
	out := make([]string, 0, len(set))
	for id := range set {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// gatherAll gathers parts of pq covering every partition once, asking again while some are missing until
// ctx ends.
func (s *Inventory) gatherAll(ctx context.Context, pq events.InventoryPartQuery) ([]events.InventoryPart, error) {
	data, err := json.Marshal(pq)
	if err != nil {
		return nil, err
	}
	// A round asked every 250 ms: a pause growing to 1 s (fewer parts asked of a replica that is loading
	// partitions) made the slowest query of a join 4.75 s instead of 2.25 s in 2 of 3 runs of
	// BenchmarkInventoryHandover.
	const pause = 250 * time.Millisecond
	for {
		parts, err := s.gatherOnce(ctx, data)
		if err == nil || !errors.Is(err, events.ErrPartsMissing) {
			return parts, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(pause):
		}
	}
}

// gatherOnce asks once and waits up to inventoryGatherRound for parts covering every partition, or until
// every live replica (by the member keys) has answered: then a partition still missing is being taken
// over, and the next round asks again after a short pause instead of waiting out this one.
func (s *Inventory) gatherOnce(ctx context.Context, data []byte) ([]events.InventoryPart, error) {
	ctx, cancel := context.WithTimeout(ctx, inventoryGatherRound)
	defer cancel()
	live := 0
	if s.owners != nil {
		live = s.owners.replicas()
	}
	var (
		parts   []events.InventoryPart
		covered [events.InventoryPartitions]int
		n       int
		twice   []int
		failed  error
	)
	gerr := s.b.Gather(ctx, events.InventoryPartsSubject, data, func(d []byte, err error) bool {
		if err != nil {
			failed = err
			return true
		}
		var part events.InventoryPart
		if err := json.Unmarshal(d, &part); err != nil {
			failed = fmt.Errorf("decode a part: %w", err)
			return true
		}
		parts = append(parts, part)
		for _, p := range part.Partitions {
			if p < 0 || p >= events.InventoryPartitions {
				continue
			}
			if covered[p]++; covered[p] == 1 {
				n++
			} else {
				twice = append(twice, p)
			}
		}
		return n < events.InventoryPartitions && (live == 0 || len(parts) < live)
	})
	if len(twice) > 0 {
		return nil, fmt.Errorf("%w: partitions %v answered by two replicas (a handover is under way); ask again", events.ErrPartsMissing, twice)
	}
	if n == events.InventoryPartitions {
		return parts, nil
	}
	var missing []int
	for p, c := range covered {
		if c == 0 {
			missing = append(missing, p)
		}
	}
	switch {
	case failed != nil:
		return nil, fmt.Errorf("%w: partitions %v: %v", events.ErrPartsMissing, missing, failed)
	case errors.Is(gerr, bus.ErrNoResponders):
		return nil, fmt.Errorf("%w: no replica answers for its partitions", events.ErrPartsMissing)
	}
	return nil, fmt.Errorf("%w: partitions %v unanswered (a replica is taking them over, or none holds them); ask again",
		events.ErrPartsMissing, missing)
}

// mergeParts merges parts that together cover every partition once into q's answer (images: whole parts).
func mergeParts(q events.InventoryQuery, parts []events.InventoryPart) (events.InventoryReply, error) {
	var rep events.InventoryReply
	switch q.What {
	case events.InventoryWhere:
		rep.Placements, rep.Continue = mergePages(q.Limit, parts, func(r events.InventoryReply) []events.Placement { return r.Placements },
			placementBefore, func(p events.Placement) string { return p.Node + "/" + p.ID })
	case events.InventoryNodes:
		rep.Nodes, rep.Continue = mergePages(q.Limit, parts, func(r events.InventoryReply) []events.InventoryNode { return r.Nodes },
			func(a, b events.InventoryNode) bool { return a.Node < b.Node }, func(n events.InventoryNode) string { return n.Node })
	case events.InventoryImages:
		byID := map[string]*events.InventoryImage{}
		mergeImages(byID, parts, "")
		return pageImages(q, imageList(byID))
	default:
		return rep, fmt.Errorf("%w: what %q must be images, where or nodes", events.ErrMalformed, q.What)
	}
	for _, part := range parts {
		rep.Total += part.Reply.Total
		rep.TotalBytes += part.Reply.TotalBytes
	}
	return rep, nil
}

// mergePages joins the parts' pages of a where or nodes answer (each sorted by before, each the first
// limit after the query's continue token) into the answer's page: the first limit of them, with the last
// one's token to continue from when the join or any part has more.
func mergePages[T any](limit int, parts []events.InventoryPart, page func(events.InventoryReply) []T,
	before func(a, b T) bool, token func(T) string) ([]T, string) {
	var all []T
	more := false
	for _, part := range parts {
		all = append(all, page(part.Reply)...)
		more = more || part.Reply.Continue != ""
	}
	sort.Slice(all, func(i, j int) bool { return before(all[i], all[j]) })
	if limit > 0 && len(all) >= limit && (more || len(all) > limit) {
		all = all[:limit]
		return all, token(all[limit-1])
	}
	return all, ""
}

// mergeImages adds the parts' images with IDs up to bound ("": all) into byID: an image's nodes and bytes
// add up, its largest size and latest use are kept, its tags and digests joined.
func mergeImages(byID map[string]*events.InventoryImage, parts []events.InventoryPart, bound string) {
	for _, part := range parts {
		for _, im := range part.Reply.Images {
			if bound != "" && im.ID > bound {
				continue
			}
			cur := byID[im.ID]
			if cur == nil {
				c := im
				c.RepoTags = append([]string(nil), im.RepoTags...)
				c.RepoDigests = append([]string(nil), im.RepoDigests...)
				byID[im.ID] = &c
				continue
			}
			cur.Nodes += im.Nodes
			cur.TotalBytes += im.TotalBytes
			cur.Size = max(cur.Size, im.Size)
			if im.LastUsed.After(cur.LastUsed) {
				cur.LastUsed = im.LastUsed
			}
			cur.RepoTags = union(cur.RepoTags, im.RepoTags)
			cur.RepoDigests = union(cur.RepoDigests, im.RepoDigests)
		}
	}
}

// imageList is byID's images with their tags and digests sorted.
func imageList(byID map[string]*events.InventoryImage) []events.InventoryImage {
	list := make([]events.InventoryImage, 0, len(byID))
	for _, im := range byID {
		sort.Strings(im.RepoTags)
		sort.Strings(im.RepoDigests)
		if len(im.RepoTags) == 0 {
			im.RepoTags = nil
		}
		if len(im.RepoDigests) == 0 {
			im.RepoDigests = nil
		}
		list = append(list, *im)
	}
	return list
}
