package gc

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// grantCopies asks the fleet's copies arbiter (events.CopiesSubject) which of the batch's unused images may
// go under the node's keepCopies, just before they are removed, and marks the others kept. The arbiter
// records what it grants, so two nodes removing at once never both take the same copies. When it cannot be
// asked (no arbiter running, a timeout), every image of the batch is kept: a pass never risks the count.
// A dry run asks without recording. The images granted are marked, for releaseCopies.
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
		default:
			out[i].granted = !p.dryRun
		}
	}
	if err != nil {
		c.log.Warn("keepCopies could not be checked, the batch is kept", "err", err, "images", len(ids))
	}
}

// releaseCopies gives the fleet's copies arbiter back the grants of the batch's removals that failed, so
// those copies count again at once rather than only when the inventory shows the image written again. A
// failure whose outcome is unknown (a timeout, the runtime unreachable, the pass's ctx ended: the runtime
// may have removed the image all the same) keeps its grant, and so does a release that fails: a grant held
// too long only makes removals rarer, a grant released for a copy that is gone lets the fleet fall below the
// count.
func (c *collector) releaseCopies(ctx context.Context, p *pass, out []outcome) {
	var ids []string
	for _, o := range out {
		if o.granted && o.err != nil && !removalMayHaveHappened(o.err) {
			ids = append(ids, o.c.ID)
		}
	}
	if len(ids) == 0 || c.bus == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, c.inUseTimeout)
	defer cancel()
	err := c.bus.Request(ctx, events.CopiesSubject(c.node), events.CopiesRequest{Node: c.node, Images: ids, Release: true}, nil)
	if err != nil {
		c.log.Warn("keepCopies grants of failed removals not released, they hold until the inventory shows the images again",
			"err", err, "images", len(ids), "policy", p.keepCopies.Policy)
	}
}

// removalMayHaveHappened reports whether a failed RemoveImage may have removed the image all the same.
func removalMayHaveHappened(err error) bool {
	return errors.Is(err, cri.ErrTimeout) || errors.Is(err, cri.ErrUnavailable) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}
