package fleet

import (
	"context"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

func (h *Heartbeat) buckets(ctx context.Context) (alive, seen *bus.KV, err error) {
	return heartbeatBuckets(ctx, h.b, h.cfg.TTL, 0) // replicas 0: the connection's Options.Replicas
}

func heartbeatBuckets(ctx context.Context, b *bus.Bus, ttl time.Duration, replicas int) (alive, seen *bus.KV, err error) {
	alive, err = b.KV(ctx, bus.KVConfig{Bucket: events.NodesBucket, TTL: ttl, Replicas: replicas,
		Description: "imagefleet node heartbeats; a key expires when its node stops"})
	if err != nil {
		return nil, nil, fmt.Errorf("heartbeat: %w", err)
	}
	seen, err = b.KV(ctx, bus.KVConfig{Bucket: events.NodesSeenBucket, Replicas: replicas,
		Description: "imagefleet nodes' last heartbeat, kept so a lost node is shown"})
	if err != nil {
		return nil, nil, fmt.Errorf("heartbeat: %w", err)
	}
	return alive, seen, nil
}

// EnsureBuckets creates the fleet's buckets and stream (heartbeats with defaultHeartbeatTTL, last
// seen, inventory, rollouts) with replicas (0: the connection's default): what `imagefleet bus init` runs
// with the admin identity, so agents with node identities, which may not create buckets, find them.
func EnsureBuckets(ctx context.Context, b *bus.Bus, replicas int) error {
	if _, _, err := heartbeatBuckets(ctx, b, defaultHeartbeatTTL, replicas); err != nil {
		return err
	}
	if _, err := b.KV(ctx, inventoryBucket(replicas)); err != nil {
		return fmt.Errorf("inventory: %w", err)
	}
	return EnsureRolloutStream(ctx, b, replicas)
}
