package gc

import (
	"context"
	"fmt"
	"slices"

	"github.com/imagefleet/imagefleet/events"
)

// grantCopies asks the fleet's copies arbiter (events.CopiesSubject) which of the batch's unused images may
// go under the node's keepCopies, just before they are removed, and marks the others kept. The arbiter
// records what it grants, so two nodes removing at once never both take the same copies. When it cannot be
// asked (no arbiter running, a timeout), every image of the batch is kept: a pass never risks the count.
// A dry run asks without recording.
func (c *collector) grantCopies(ctx context.Context, p *pass, out []outcome) {
	k := p.keepCopies
	if k == nil || c.bus == nil {
		return
	}
	var ids []string
	for _, o := range out {
		if !o.inUse {
			ids = append(ids, o.c.ID)
		}
	}
	if len(ids) == 0 {
		return
	}
	where := "the fleet"
	if k.TopologyKey != "" {
		where = fmt.Sprintf("zone %s=%s", k.TopologyKey, k.Zone)
	}
	ctx, cancel := context.WithTimeout(ctx, c.inUseTimeout)
	defer cancel()
	var rep events.CopiesReply
	err := c.bus.Request(ctx, events.CopiesSubject(c.node), events.CopiesRequest{Node: c.node, Images: ids, Count: k.Count,
		TopologyKey: k.TopologyKey, Zone: k.Zone, DryRun: p.dryRun}, &rep)
	for i := range out {
		switch {
		case out[i].inUse:
		case err != nil:
			out[i].kept = fmt.Sprintf("kept: keepCopies could not be checked (policy %s)", k.Policy)
		case !slices.Contains(rep.Allowed, out[i].c.ID):
			out[i].kept = fmt.Sprintf("kept: one of the last %d copies in %s (policy %s)", k.Count, where, k.Policy)
		}
	}
	if err != nil {
		c.log.Warn("keepCopies could not be checked, the batch is kept", "err", err, "images", len(ids))
	}
}
