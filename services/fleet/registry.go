package fleet

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Registry reads (and, for the heartbeat worker, writes) the node registry.
type Registry struct {
	b         *bus.Bus
	clock     func() time.Time
	lostAfter time.Duration

	mu          sync.Mutex
	alive, seen *bus.KV // nil while the bucket does not exist; looked for again at each read
}

// RegistryOptions tune a Registry reader.
type RegistryOptions struct {
	// LostAfter overrides the lost threshold (default: 3 periods of each node's heartbeat).
	LostAfter time.Duration
	// Clock returns now (default time.Now).
	Clock func() time.Time
}

// OpenRegistry opens the registry buckets for reading; missing buckets read as an empty registry until
// they are created.
func OpenRegistry(ctx context.Context, b *bus.Bus, o RegistryOptions) (*Registry, error) {
	r := &Registry{b: b, clock: o.Clock, lostAfter: o.LostAfter}
	if r.clock == nil {
		r.clock = time.Now
	}
	if _, _, err := r.buckets(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// buckets returns the TTL and last-seen buckets, nil for one that does not exist, looking again for one
// that did not exist before: the first heartbeat creates them one after the other, so a registry opened
// between the two (or before either) would otherwise never read the bucket created later.
func (r *Registry) buckets(ctx context.Context) (alive, seen *bus.KV, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, bk := range []struct {
		kv   **bus.KV
		name string
	}{{&r.alive, events.NodesBucket}, {&r.seen, events.NodesSeenBucket}} {
		if *bk.kv != nil {
			continue
		}
		kv, err := r.b.KVExisting(ctx, bk.name)
		if err != nil && !errors.Is(err, bus.ErrBucketNotFound) {
			return nil, nil, fmt.Errorf("open node registry: %w", err)
		}
		*bk.kv = kv
	}
	return r.alive, r.seen, nil
}

// Nodes lists every node that ever heartbeated, with its state, sorted by name.
func (r *Registry) Nodes(ctx context.Context) ([]events.NodeStatus, error) {
	page, err := r.List(ctx, NodeQuery{})
	return page.Nodes, err
}

// Forget removes a node from the registry (a decommissioned node is no longer shown as lost).
func (r *Registry) Forget(ctx context.Context, node string) error {
	aliveKV, seenKV, err := r.buckets(ctx)
	if err != nil {
		return err
	}
	if seenKV == nil {
		return nil
	}
	if err := seenKV.Delete(ctx, events.NodeToken(node)); err != nil {
		return fmt.Errorf("forget node %s: %w", node, err)
	}
	if aliveKV != nil {
		if err := aliveKV.Delete(ctx, events.NodeToken(node)); err != nil {
			return fmt.Errorf("forget node %s: %w", node, err)
		}
	}
	return nil
}
