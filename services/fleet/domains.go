package fleet

import (
	"context"
	"encoding/json"
	"errors"
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

// NodeDomain is the JetStream domain of node's pull work queue as its last full heartbeat reports it
// (events.NodeInfo.JSDomain): "" for a node in the fleet's own domain, and for a node the registry does not
// know. A command that queues a pull for one node (imagefleet pull) addresses it there.
func NodeDomain(ctx context.Context, b *bus.Bus, node string) (string, error) {
	seen, err := b.KVExisting(ctx, events.NodesSeenBucket)
	if errors.Is(err, bus.ErrBucketNotFound) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("domain of node %s: %w", node, err)
	}
	raw, _, err := seen.Get(ctx, events.NodeToken(node))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("domain of node %s: %w", node, err)
	}
	var info events.NodeInfo
	if err := json.Unmarshal(raw, &info); err != nil {
		return "", fmt.Errorf("domain of node %s: heartbeat record: %w", node, err)
	}
	return info.JSDomain, nil
}
