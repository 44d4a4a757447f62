package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// SourcedStreamConfig is a stream the server fills by copying another stream's messages as they are
// stored, with their subjects rewritten by a subject transform (for example to put a partition number in
// front, so each partition can have a durable consumer of its own: events.InventoryStream).
type SourcedStreamConfig struct {
	Name        string
	Description string
	// Origin is the stream copied; Filter selects its messages and Transform is the copy's subject (a
	// subject transform destination: {{wildcard(n)}}, {{partition(n,k)}}, a trailing >).
	Origin, Filter, Transform string
	// WorkQueue removes a copy once a consumer acked it (the copy holds a backlog, not a history); else
	// limits retention.
	WorkQueue bool
	MaxAge    time.Duration
	MaxBytes  int64
	// MaxConsumers (0: the server's default).
	MaxConsumers int
	// Replicas (0: the connection's Options.Replicas; an existing stream keeps its own if that is 0 too).
	Replicas int
}

func (sc SourcedStreamConfig) stream() jetstream.StreamConfig {
	retention := jetstream.LimitsPolicy
	if sc.WorkQueue {
		retention = jetstream.WorkQueuePolicy
	}
	return jetstream.StreamConfig{
		Name:        sc.Name,
		Description: sc.Description,
		Sources: []*jetstream.StreamSource{{Name: sc.Origin,
			SubjectTransforms: []jetstream.SubjectTransformConfig{{Source: sc.Filter, Destination: sc.Transform}}}},
		Storage:      jetstream.FileStorage,
		Retention:    retention,
		MaxAge:       sc.MaxAge,
		MaxBytes:     sc.MaxBytes,
		Duplicates:   2 * time.Minute,
		Replicas:     sc.Replicas,
		Discard:      jetstream.DiscardOld,
		MaxConsumers: sc.MaxConsumers,
	}
}

// EnsureSourcedStream creates the stream or brings an existing one to sc in place: another source or
// transform is replaced (the server keeps the copies made so far and goes on from the origin's next message;
// compat_sourced_transform.go), limits are updated. Retention cannot change in place: a stream made with
// another is kept as it is, with a warning. Like EnsureStreams it is idempotent, and an identity that may
// only read stream info finds the stream an operator made (imagefleet bus init) and goes on.
func (b *Bus) EnsureSourcedStream(ctx context.Context, sc SourcedStreamConfig) error {
	if sc.Name == "" || sc.Origin == "" || sc.Filter == "" || sc.Transform == "" {
		return fmt.Errorf("sourced stream %q needs a name, an origin, a filter and a transform", sc.Name)
	}
	want := sc.stream()
	return b.retryTransient(ctx, "stream "+sc.Name, func(actx context.Context) error {
		s, err := b.js.Stream(actx, sc.Name)
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("stream %s: %w", sc.Name, err)
		}
		if err == nil && !sameSources(s.CachedInfo().Config.Sources, want.Sources) {
			return b.replaceSources(actx, s.CachedInfo().Config, want) // compat_sourced_transform.go
		}
		if want.Replicas == 0 {
			want.Replicas = b.replicas
		}
		return b.ensureStreamOnce(actx, want, 0)
	})
}
