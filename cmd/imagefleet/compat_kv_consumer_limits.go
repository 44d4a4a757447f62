// Compatibility path: buckets made before the per-node watcher limit.
//
// A bucket made before buckets got the shared streams' consumer limit (events.SharedStreamMaxConsumers)
// keeps the server's default, 1,000 consumers, and every node watches its own keys of the shared buckets, so
// a fleet starting more than a thousand agents at once had watchers refused. A bucket made now is raised as
// it is created (bus.Bus.KV); `imagefleet bus init` raises every existing one (raiseBucketConsumers).
//
// Remove when: every bucket was brought to the current settings by `bus init` (docs/upgrading.md,
// "Compatibility paths").

package main

import (
	"context"

	"github.com/imagefleet/imagefleet/bus"
)

// raiseBucketConsumers raises the consumer limit of every bucket still at the server's 1,000 to the limit a
// bucket made now has (every node watches its own keys of the shared buckets).
func raiseBucketConsumers(ctx context.Context, b *bus.Bus) error {
	buckets, err := b.BucketNames(ctx)
	if err != nil {
		return err
	}
	for _, name := range buckets {
		if err := b.RaiseBucketConsumers(ctx, name); err != nil {
			return err
		}
	}
	return nil
}
