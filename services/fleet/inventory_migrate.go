package fleet

import (
	"context"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// EnsureInventoryStream creates events.InventoryStream, the server's partitioned copy of every node's image
// events, or brings an earlier one to this release's settings in place (imagefleet bus init
// --inventory-partitioned, and every partitioned inventory replica at start). replicas 0: the connection's
// Options.Replicas.
func EnsureInventoryStream(ctx context.Context, b *bus.Bus, replicas int) error {
	return b.EnsureSourcedStream(ctx, bus.SourcedStreamConfig{
		Name: events.InventoryStream,
		Description: fmt.Sprintf("image events of %s, partitioned by node into %d for the fleet inventory",
			events.EventsStream, events.InventoryPartitions),
		Origin: events.EventsStream, Filter: events.InventorySourceFilter, Transform: events.InventorySourceTransform(),
		// A copy is dropped once applied; the limits only bound a backlog no inventory drains.
		WorkQueue: true, MaxAge: 7 * 24 * time.Hour, MaxBytes: 1 << 30, Replicas: replicas,
	})
}

// MigrateInventoryStream brings an existing events.InventoryStream to this release's settings and creates
// none: what imagefleet bus init does without --inventory-partitioned (a copy nobody drains would fill up).
func MigrateInventoryStream(ctx context.Context, b *bus.Bus, replicas int) error {
	if _, err := b.Stream(ctx, events.InventoryStream); err != nil {
		if bus.IsStreamNotFound(err) {
			return nil
		}
		return err
	}
	return EnsureInventoryStream(ctx, b, replicas)
}
