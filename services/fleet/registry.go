package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// DefaultLostAfterPeriods is how many heartbeat periods a node may miss before it is shown as lost.
const DefaultLostAfterPeriods = 3

// DefaultHeartbeatPeriod is how often an agent heartbeats unless told otherwise.
const DefaultHeartbeatPeriod = 10 * time.Second

// NodeStates computes each node's state from its last heartbeat (seen, kept forever), whether its key is
// still in the TTL bucket (alive), and now. A node is Ready when its heartbeat key has not expired and its
// last heartbeat is at most lostAfter old (0: DefaultLostAfterPeriods of the node's own period); otherwise
// it is Lost. The TTL is the server's clock, the age the node's: either one noticing silence is enough.
// The result is sorted by node name.
func NodeStates(seen []events.NodeInfo, alive map[string]bool, now time.Time, lostAfter time.Duration) []events.NodeStatus {
	out := make([]events.NodeStatus, 0, len(seen))
	for _, n := range seen {
		limit := lostAfter
		if limit <= 0 {
			limit = time.Duration(DefaultLostAfterPeriods) * n.Period.Duration
		}
		age := now.Sub(n.Heartbeat)
		if age < 0 {
			age = 0
		}
		st := events.NodeStatus{NodeInfo: n, State: events.NodeReady, Age: events.Duration{Duration: age}}
		if !alive[n.Node] || (limit > 0 && age > limit) {
			st.State = events.NodeLost
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	return out
}

// Registry reads (and, for the heartbeat worker, writes) the node registry.
type Registry struct {
	alive, seen *bus.KV
	clock       func() time.Time
	lostAfter   time.Duration
}

// RegistryOptions tune a Registry reader.
type RegistryOptions struct {
	// LostAfter overrides the lost threshold (default: 3 periods of each node's heartbeat).
	LostAfter time.Duration
	// Clock returns now (default time.Now).
	Clock func() time.Time
}

// OpenRegistry opens the registry buckets for reading; missing buckets read as an empty registry.
func OpenRegistry(ctx context.Context, b *bus.Bus, o RegistryOptions) (*Registry, error) {
	r := &Registry{clock: o.Clock, lostAfter: o.LostAfter}
	if r.clock == nil {
		r.clock = time.Now
	}
	var err error
	if r.alive, err = b.KVExisting(ctx, events.NodesBucket); err != nil && !errors.Is(err, bus.ErrBucketNotFound) {
		return nil, fmt.Errorf("open node registry: %w", err)
	}
	if r.seen, err = b.KVExisting(ctx, events.NodesSeenBucket); err != nil && !errors.Is(err, bus.ErrBucketNotFound) {
		return nil, fmt.Errorf("open node registry: %w", err)
	}
	return r, nil
}

// Nodes lists every node that ever heartbeated, with its state, sorted by name.
func (r *Registry) Nodes(ctx context.Context) ([]events.NodeStatus, error) {
	if r.seen == nil {
		return nil, nil
	}
	seenEntries, err := r.seen.List(ctx, ">")
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	alive := map[string]bool{}
	if r.alive != nil {
		aliveEntries, err := r.alive.List(ctx, ">")
		if err != nil {
			return nil, fmt.Errorf("list live nodes: %w", err)
		}
		for _, e := range aliveEntries {
			alive[events.NodeFromToken(e.Key)] = true
		}
	}
	seen := make([]events.NodeInfo, 0, len(seenEntries))
	for _, e := range seenEntries {
		var n events.NodeInfo
		if err := json.Unmarshal(e.Value, &n); err != nil || n.Node == "" {
			continue // a foreign or damaged value is not a node
		}
		seen = append(seen, n)
	}
	return NodeStates(seen, alive, r.clock(), r.lostAfter), nil
}

// Forget removes a node from the registry (a decommissioned node is no longer shown as lost).
func (r *Registry) Forget(ctx context.Context, node string) error {
	if r.seen == nil {
		return nil
	}
	if err := r.seen.Delete(ctx, events.NodeToken(node)); err != nil {
		return fmt.Errorf("forget node %s: %w", node, err)
	}
	if r.alive != nil {
		if err := r.alive.Delete(ctx, events.NodeToken(node)); err != nil {
			return fmt.Errorf("forget node %s: %w", node, err)
		}
	}
	return nil
}

// ParseSelector parses a label selector (the Kubernetes syntax: k=v, k!=v, k in (a,b), !k, ...). The empty
// string selects everything.
func ParseSelector(s string) (labels.Selector, error) {
	sel, err := labels.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("parse selector %q: %w", s, err)
	}
	return sel, nil
}

// SelectNodes picks the nodes whose labels match sel, in name order. Lost nodes are returned apart (skipped)
// unless includeLost, in which case they are planned like the rest (and will fail if they do not answer).
func SelectNodes(nodes []events.NodeStatus, sel labels.Selector, includeLost bool) (chosen []string, skipped []events.RolloutNodeError) {
	sorted := append([]events.NodeStatus(nil), nodes...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Node < sorted[j].Node })
	for _, n := range sorted {
		if !sel.Matches(labels.Set(n.Labels)) {
			continue
		}
		if n.State != events.NodeReady && !includeLost {
			skipped = append(skipped, events.RolloutNodeError{Node: n.Node,
				Error: fmt.Sprintf("node is %s (last heartbeat %s ago)", n.State, n.Age.Round(time.Second))})
			continue
		}
		chosen = append(chosen, n.Node)
	}
	return chosen, skipped
}

// ParseLabels parses --node-labels: k=v pairs separated by commas, with Kubernetes label key and value rules.
func ParseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("label %q is not key=value", kv)
		}
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return nil, fmt.Errorf("label key %q: %s", k, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, fmt.Errorf("label value %q of %s: %s", v, k, strings.Join(errs, "; "))
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("label %q given twice", k)
		}
		out[k] = v
	}
	return out, nil
}
