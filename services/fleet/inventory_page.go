package fleet

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/imagefleet/imagefleet/events"
)

// pageImages sorts images (biggest fleet total first) and keeps the page q asks for.
func pageImages(q events.InventoryQuery, images []events.InventoryImage) (events.InventoryReply, error) {
	rep := events.InventoryReply{Images: images}
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	for _, im := range images {
		rep.TotalBytes += im.TotalBytes
	}
	sort.Slice(rep.Images, func(i, j int) bool { return imageBefore(rep.Images[i], rep.Images[j]) })
	rep.Total = len(rep.Images)
	if q.Continue != "" {
		after, err := parseImageContinue(q.Continue)
		if err != nil {
			return rep, err
		}
		i := sort.Search(len(rep.Images), func(i int) bool { return imageBefore(after, rep.Images[i]) })
		rep.Images = rep.Images[i:]
	}
	if q.Limit > 0 && len(rep.Images) > q.Limit {
		rep.Images = rep.Images[:q.Limit]
		last := rep.Images[q.Limit-1]
		rep.Continue = fmt.Sprintf("%d/%s", last.TotalBytes, last.ID)
	}
	if len(rep.Images) == 0 {
		rep.Images = nil
	}
	return rep, nil
}

// pageNodes sorts nodes by name and keeps the page q asks for.
func pageNodes(q events.InventoryQuery, nodes []events.InventoryNode) (events.InventoryReply, error) {
	rep := events.InventoryReply{Nodes: nodes}
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	for _, n := range nodes {
		rep.TotalBytes += n.TotalBytes
	}
	sort.Slice(rep.Nodes, func(i, j int) bool { return rep.Nodes[i].Node < rep.Nodes[j].Node })
	rep.Total = len(rep.Nodes)
	if q.Continue != "" {
		i := sort.Search(len(rep.Nodes), func(i int) bool { return rep.Nodes[i].Node > q.Continue })
		rep.Nodes = rep.Nodes[i:]
	}
	if q.Limit > 0 && len(rep.Nodes) > q.Limit {
		rep.Nodes = rep.Nodes[:q.Limit]
		rep.Continue = rep.Nodes[q.Limit-1].Node
	}
	if len(rep.Nodes) == 0 {
		rep.Nodes = nil
	}
	return rep, nil
}

// imageBefore orders images by fleet bytes, biggest first, then by ID.
func imageBefore(a, b events.InventoryImage) bool {
	if a.TotalBytes != b.TotalBytes {
		return a.TotalBytes > b.TotalBytes
	}
	return a.ID < b.ID
}

// placementBefore orders placements by node, then image ID.
func placementBefore(a, b events.Placement) bool {
	if a.Node != b.Node {
		return a.Node < b.Node
	}
	return a.ID < b.ID
}

// parseImageContinue reads an images page's continue token: <total bytes>/<image ID>.
func parseImageContinue(token string) (events.InventoryImage, error) {
	n, id, ok := strings.Cut(token, "/")
	bytes, err := strconv.ParseInt(n, 10, 64)
	if !ok || err != nil || id == "" {
		return events.InventoryImage{}, fmt.Errorf("%w: continue token %q is not one of an images page", events.ErrMalformed, token)
	}
	return events.InventoryImage{TotalBytes: bytes, ID: id}, nil
}
