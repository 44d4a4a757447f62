package fleet

import (
	"context"
	"fmt"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// nodeDomains reads from the registry the JetStream domain of every node whose pull work queue is on a
// leaf nats-server with a domain of its own (events.NodeInfo.JSDomain): a pull request for such a node is
// addressed to its domain, since every leaf's queue takes the plain subjects (bus/domains.go). Nodes in the
// fleet's own domain are left out; the map is empty in a fleet of one domain.
func nodeDomains(ctx context.Context, b *bus.Bus) (map[string]string, error) {
	reg, err := OpenRegistry(ctx, b, RegistryOptions{})
	if err != nil {
		return nil, err
	}
	nodes, err := reg.Nodes(ctx)
	if err != nil {
		return nil, fmt.Errorf("node domains: %w", err)
	}
	domains := map[string]string{}
	for _, n := range nodes {
		if n.JSDomain != "" {
			domains[n.Node] = n.JSDomain
		}
	}
	return domains, nil
}

// pullSubject is where the rollout publishes node's pull request: the node's pull subject, addressed to
// the node's JetStream domain when it has one of its own.
func (w *PullWatch) pullSubject(node string) string {
	return events.DomainSubject(w.domains[node], events.PullSubject(node))
}
