// Compatibility path: a sourced stream made with the transform of an earlier layout.
//
// IMAGEFLEET_INVENTORY (events.InventoryStream) is sourced from the events stream with a subject transform
// that puts a partition number in front. A stream made with another source or transform is brought to the
// current one in place by EnsureSourcedStream (`imagefleet bus init`, and a partitioned inventory replica at
// start: services/fleet/inventory_migrate.go): the server keeps the copies made so far and goes on from the
// origin's next message. Its retention, which cannot change in place, is kept, with a warning.
//
// Remove when: every such stream was brought to the current settings by `bus init` (docs/upgrading.md,
// "Compatibility paths").

package bus

import (
	"cmp"
	"context"

	"github.com/nats-io/nats.go/jetstream"
)

// replaceSources brings an existing sourced stream, whose settings are have, to want, whose sources or
// transform differ. An identity that may not update the stream keeps it as it is, with a warning.
func (b *Bus) replaceSources(ctx context.Context, have, want jetstream.StreamConfig) error {
	// A new transform is this stream's point: it is updated even where ensureStreamOnce would keep
	// the stream as it is (another retention, which cannot change in place).
	if want.Replicas == 0 {
		want.Replicas = cmp.Or(b.replicas, have.Replicas)
	}
	if have.Retention != want.Retention {
		b.log.Warn("stream kept with its existing retention", "stream", want.Name)
		want.Retention = have.Retention
	}
	b.updateOrKeep(ctx, want)
	return nil
}
