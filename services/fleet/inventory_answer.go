package fleet

import (
	"fmt"
	"sort"
	"strings"

	"github.com/imagefleet/imagefleet/events"
)

// answer aggregates the placements each yields (for where: the matching ones) into a reply, sorted, and
// keeps the page after q.Continue of at most q.Limit entries. Total and TotalBytes count every page.
func answer(q events.InventoryQuery, each func(yield func(events.Placement))) (events.InventoryReply, error) {
	var rep events.InventoryReply
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	switch q.What {
	case events.InventoryImages:
		byID := map[string]*events.InventoryImage{}
		each(func(p events.Placement) {
			im := byID[p.ID]
			if im == nil {
				im = &events.InventoryImage{ID: p.ID, Size: p.Size}
				byID[p.ID] = im
			}
			im.Nodes++
			im.TotalBytes += p.Size
			im.Size = max(im.Size, p.Size)
			im.RepoTags = union(im.RepoTags, p.RepoTags)
			im.RepoDigests = union(im.RepoDigests, p.RepoDigests)
			if p.LastUsed.After(im.LastUsed) {
				im.LastUsed = p.LastUsed
			}
		})
		list := make([]events.InventoryImage, 0, len(byID))
		for _, im := range byID {
			sort.Strings(im.RepoTags) // sorted, as a replica's totals give them (sortedKeys)
			sort.Strings(im.RepoDigests)
			list = append(list, *im)
		}
		return pageImages(q, list)
	case events.InventoryNodes:
		byNode := map[string]*events.InventoryNode{}
		each(func(p events.Placement) {
			n := byNode[p.Node]
			if n == nil {
				n = &events.InventoryNode{Node: p.Node}
				byNode[p.Node] = n
			}
			n.Images++
			n.TotalBytes += p.Size
		})
		list := make([]events.InventoryNode, 0, len(byNode))
		for _, n := range byNode {
			list = append(list, *n)
		}
		return pageNodes(q, list)
	case events.InventoryWhere:
		each(func(p events.Placement) {
			rep.Placements = append(rep.Placements, p)
			rep.TotalBytes += p.Size
		})
		sort.Slice(rep.Placements, func(i, j int) bool { return placementBefore(rep.Placements[i], rep.Placements[j]) })
		rep.Total = len(rep.Placements)
		if q.Continue != "" {
			node, id, _ := strings.Cut(q.Continue, "/")
			after := events.Placement{Node: node, ID: id}
			i := sort.Search(len(rep.Placements), func(i int) bool { return placementBefore(after, rep.Placements[i]) })
			rep.Placements = rep.Placements[i:]
		}
		if q.Limit > 0 && len(rep.Placements) > q.Limit {
			rep.Placements = rep.Placements[:q.Limit]
			last := rep.Placements[q.Limit-1]
			rep.Continue = last.Node + "/" + last.ID
		}
	default:
		return rep, fmt.Errorf("%w: what %q must be images, where or nodes", events.ErrMalformed, q.What)
	}
	return rep, nil
}

func union(a, b []string) []string {
	for _, s := range b {
		found := false
		for _, t := range a {
			if s == t {
				found = true
				break
			}
		}
		if !found {
			a = append(a, s)
		}
	}
	return a
}
