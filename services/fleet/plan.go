package fleet

import (
	"context"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// NodePlan is a rollout's nodes as the registry showed them when it was planned.
type NodePlan struct {
	// Nodes are the nodes to act on, in name order.
	Nodes []string
	// Skipped are the matching nodes left out because they are not Ready (unless includeLost), with why.
	Skipped []events.RolloutNodeError
	// Domains maps each matching node whose pull work queue is on a leaf with a JetStream domain of its own
	// to that domain (events.NodeInfo.JSDomain); a node in the fleet's own domain is not in it. A pre-pull
	// addresses its requests with it (WithNodeDomains), so it needs no second read of the registry.
	Domains map[string]string
}

// Plan picks a rollout's nodes from the registry: those matching selector, Ready ones only unless
// includeLost (lost ones are returned as skipped), in name order. The registry is read once, streamed, with
// the selector applied to each record as it goes by (Registry.List): memory is the matching nodes, not the
// fleet. The choice is selectNodes's over the whole registry, node for node.
func Plan(ctx context.Context, b *bus.Bus, selector string, includeLost bool, clock func() time.Time) (NodePlan, error) {
	sel, err := ParseSelector(selector)
	if err != nil {
		return NodePlan{}, err
	}
	reg, err := OpenRegistry(ctx, b, RegistryOptions{Clock: clock})
	if err != nil {
		return NodePlan{}, err
	}
	page, err := reg.List(ctx, NodeQuery{Selector: sel})
	if err != nil {
		return NodePlan{}, err
	}
	// selectNodes matches again against each node's merged record (the TTL bucket's full record of a
	// previous-release agent, where it is the newer), as a plan over the whole registry did.
	p := NodePlan{Domains: map[string]string{}}
	p.Nodes, p.Skipped = selectNodes(page.Nodes, sel, includeLost)
	for _, n := range page.Nodes {
		if n.JSDomain != "" {
			p.Domains[n.Node] = n.JSDomain
		}
	}
	return p, nil
}
