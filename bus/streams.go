package bus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// StreamsConfig sizes the streams.
type StreamsConfig struct {
	// EventsMaxAge is how long events are kept (default 7 days).
	EventsMaxAge time.Duration
	// EventsMaxBytes caps the events stream (default 1 GiB).
	EventsMaxBytes int64
	// PodsMaxAge is how long pod events are kept in the pods stream (default 30 days).
	PodsMaxAge time.Duration
	// PodsMaxBytes caps the pods stream (default 4 GiB).
	PodsMaxBytes int64
	// Replicas for every stream (0: the connection's Options.Replicas; if that is 0 too, new streams get 1
	// and existing ones keep theirs).
	Replicas int
	// PullReplicas for the pull work queue's partition streams, and so for every node's pull consumer, which
	// takes its stream's replicas (0: an existing partition keeps its replicas, a new one gets Replicas).
	// On a cluster too small for one R3 Raft group per node (docs/scale.md) an operator makes them R1 with
	// `imagefleet bus init --pull-replicas 1` while the fleet-wide streams and buckets stay R3; an agent
	// started with --stream-replicas then leaves them as they are.
	PullReplicas int
}

// EnsureStreams creates or updates the events and pods streams, the pull work queues (the partitions and the
// legacy single queue) and the dead-letter stream.
// It is idempotent: every agent and command calls it at start.
func (b *Bus) EnsureStreams(ctx context.Context, cfg StreamsConfig) error {
	if cfg.EventsMaxAge == 0 {
		cfg.EventsMaxAge = 7 * 24 * time.Hour
	}
	if cfg.EventsMaxBytes == 0 {
		cfg.EventsMaxBytes = 1 << 30
	}
	if cfg.PodsMaxAge == 0 {
		cfg.PodsMaxAge = 30 * 24 * time.Hour
	}
	if cfg.PodsMaxBytes == 0 {
		cfg.PodsMaxBytes = 4 << 30
	}
	streams := []jetstream.StreamConfig{
		{
			Name:        events.EventsStream,
			Description: "imagefleet events of every node",
			Subjects:    []string{events.EventsSubjects},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			MaxAge:      cfg.EventsMaxAge,
			MaxBytes:    cfg.EventsMaxBytes,
			Duplicates:  2 * time.Minute,
			Replicas:    cfg.Replicas,
			Discard:     jetstream.DiscardOld,
			// Every node holds consumers of its own here (removals, kube-events): past the server's default.
			MaxConsumers: events.SharedStreamMaxConsumers,
		},
		{
			// The pod events, copied by the server from the events stream as they are stored, with limits of
			// their own (limits retention: the pod index reads with an ordered consumer, which acks nothing and
			// is gone while the index restarts, so interest retention would drop them).
			Name:        events.PodsStream,
			Description: "pod events of every node, sourced from " + events.EventsStream,
			Sources:     []*jetstream.StreamSource{{Name: events.EventsStream, FilterSubject: events.PodsStreamFilter}},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			MaxAge:      cfg.PodsMaxAge,
			MaxBytes:    cfg.PodsMaxBytes,
			Duplicates:  2 * time.Minute,
			Replicas:    cfg.Replicas,
			Discard:     jetstream.DiscardOld,
			// Every node's pod index holds an ordered consumer here: past the server's default.
			MaxConsumers: events.SharedStreamMaxConsumers,
		},
		legacyPullStreamConfig(cfg.Replicas), // the single pull queue of the older layout (compat_single_queue.go)
		{
			Name:        events.DeadLetterStream,
			Description: "messages that were terminated or exhausted their deliveries",
			Subjects:    []string{events.DeadLetterPrefix + ".>"},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			MaxAge:      30 * 24 * time.Hour,
			MaxBytes:    256 << 20,
			Replicas:    cfg.Replicas,
		},
	}
	for _, sc := range streams {
		if err := b.ensureStream(ctx, sc); err != nil {
			return err
		}
	}
	for p := range events.PullPartitions {
		sc := pullStreamConfig(events.PullPartitionStream(p), events.PullPartitionSubjects(p),
			events.PullPartitionMaxConsumers, cfg.PullReplicas,
			fmt.Sprintf("image pull commands of partition %02d of %d, one work queue consumer per node", p, events.PullPartitions))
		if err := b.ensurePullStream(ctx, sc, cfg.Replicas); err != nil {
			return err
		}
	}
	return nil
}

// ensurePullStream ensures a pull partition. With its replicas given it is ensureStream; with 0 an existing
// partition keeps its replicas whatever the connection's Options.Replicas says, and a new one gets
// newReplicas (0: the connection's).
func (b *Bus) ensurePullStream(ctx context.Context, sc jetstream.StreamConfig, newReplicas int) error {
	if sc.Replicas != 0 {
		return b.ensureStream(ctx, sc)
	}
	sc = b.inDomain(sc)
	return b.retryTransient(ctx, "stream "+sc.Name, func(actx context.Context) error {
		return b.ensureStreamOnce(actx, sc, cmp.Or(newReplicas, b.replicas))
	})
}

// pullStreamConfig is a pull work queue: the legacy one or a partition. Its consumers take the stream's
// replicas, so on a cluster with Replicas 3 each node's consumer is R3 (a lost server loses no consumer
// state).
func pullStreamConfig(name, subjects string, maxConsumers, replicas int, description string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        name,
		Description: description,
		Subjects:    []string{subjects},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.WorkQueuePolicy,
		Duplicates:  2 * time.Minute,
		Replicas:    replicas,
		// One subject per node: at most MaxPullRequestsPerNode requests in flight or waiting per node,
		// and the next publish is refused at once (backpressure, not a blocked caller; kubelet W-G).
		MaxMsgsPerSubject:    events.MaxPullRequestsPerNode,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		// Explicit, not the server's default: one durable per node of the partition (0: the default).
		MaxConsumers: maxConsumers,
	}
}

func (b *Bus) ensureStream(ctx context.Context, sc jetstream.StreamConfig) error {
	if sc.Replicas == 0 {
		sc.Replicas = b.replicas
	}
	sc = b.inDomain(sc)
	return b.retryTransient(ctx, "stream "+sc.Name, func(actx context.Context) error { return b.ensureStreamOnce(actx, sc, 0) })
}

// ensureStreamOnce creates sc or brings the existing stream to it. Replicas 0 keeps an existing stream's
// replicas and gives a new one newReplicas (at least 1).
func (b *Bus) ensureStreamOnce(ctx context.Context, sc jetstream.StreamConfig, newReplicas int) error {
	// Look before writing: a node identity may read stream info but not create or update streams, so an
	// agent started with one finds the streams an operator made and goes on (a refused update would cost a
	// JetStream API timeout at every start).
	s, err := b.js.Stream(ctx, sc.Name)
	switch {
	case err == nil:
		have := s.CachedInfo().Config
		if sc.Replicas == 0 {
			sc.Replicas = have.Replicas // unspecified: keep
		}
		if streamMatches(have, sc) {
			return nil
		}
		if sc.MaxConsumers > 0 && !enoughConsumers(sc.MaxConsumers, have.MaxConsumers) {
			sc.MaxConsumers = have.MaxConsumers // raised by an operator: keep
		}
		// Settings changed (a new release, --stream-replicas): update. A stream made with other immutable
		// settings, or an identity without the right to update, keeps the stream as it is.
		b.updateOrKeep(ctx, sc)
		return nil
	case errors.Is(err, jetstream.ErrStreamNotFound):
		sc.Replicas = max(cmp.Or(sc.Replicas, newReplicas), 1)
		err := b.refusable(ctx, b.apiPrefix(sc.Name)+"STREAM.CREATE."+sc.Name, func(ctx context.Context) error {
			_, err := b.js.CreateStream(ctx, sc)
			return err
		})
		if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("create stream %s (an operator with the admin identity creates streams: imagefleet bus init): %w", sc.Name, err)
		}
		return nil
	default:
		return fmt.Errorf("stream %s: %w", sc.Name, err)
	}
}

// streamMatches reports whether an existing stream has the settings ensureStream would give it (the server
// stores "no limit" as -1 and an unset duplicate window as 2 minutes).
func streamMatches(have, want jetstream.StreamConfig) bool {
	unlimited := func(v int64) int64 {
		if v == 0 {
			return -1
		}
		return v
	}
	window := func(d time.Duration) time.Duration {
		if d == 0 {
			return 2 * time.Minute
		}
		return d
	}
	return slices.Equal(have.Subjects, want.Subjects) && have.Retention == want.Retention &&
		have.Storage == want.Storage && have.Replicas == want.Replicas && have.MaxAge == want.MaxAge &&
		unlimited(have.MaxBytes) == unlimited(want.MaxBytes) &&
		unlimited(have.MaxMsgsPerSubject) == unlimited(want.MaxMsgsPerSubject) &&
		have.Discard == want.Discard && have.DiscardNewPerSubject == want.DiscardNewPerSubject &&
		window(have.Duplicates) == window(want.Duplicates) && sameSources(have.Sources, want.Sources) &&
		enoughConsumers(have.MaxConsumers, want.MaxConsumers)
}

// enoughConsumers: a stream's MaxConsumers is a floor, not a pin. An operator who raised it (nats stream
// edit, to hold more nodes in a partition) keeps the higher value; 0 wants the server's default. A stream's
// -1 is not unlimited: the server then applies its default_max_consumers (1,000), so it is not enough.
func enoughConsumers(have, want int) bool {
	return want == 0 || have >= want
}

// sameSources reports whether two streams source the same streams with the same filters and subject
// transforms.
func sameSources(a, b []*jetstream.StreamSource) bool {
	return slices.EqualFunc(a, b, func(x, y *jetstream.StreamSource) bool {
		return x.Name == y.Name && x.FilterSubject == y.FilterSubject &&
			slices.Equal(x.SubjectTransforms, y.SubjectTransforms)
	})
}

// EnsureStream creates or updates any stream (used by workers with streams of their own).
func (b *Bus) EnsureStream(ctx context.Context, sc StreamConfig) error {
	storage := jetstream.FileStorage
	if sc.Memory {
		storage = jetstream.MemoryStorage
	}
	retention := jetstream.LimitsPolicy
	if sc.WorkQueue {
		retention = jetstream.WorkQueuePolicy
	}
	return b.ensureStream(ctx, jetstream.StreamConfig{
		Name: sc.Name, Subjects: sc.Subjects, Storage: storage, Retention: retention, MaxAge: sc.MaxAge,
		MaxBytes: sc.MaxBytes, MaxMsgsPerSubject: sc.MaxMsgsPerSubject, Duplicates: 2 * time.Minute,
		Replicas: sc.Replicas,
	})
}

// StreamConfig is the subset of stream settings workers choose.
type StreamConfig struct {
	Name              string
	Subjects          []string
	Memory            bool
	WorkQueue         bool
	MaxAge            time.Duration
	MaxBytes          int64
	MaxMsgsPerSubject int64
	Replicas          int
}

// StreamInfo is what an operator wants to see of a stream.
type StreamInfo struct {
	Name     string
	Messages uint64
	Bytes    uint64
	FirstSeq uint64
	LastSeq  uint64
	// Consumers is the number of consumers on the stream.
	Consumers int
	// MaxAge, Replicas and MaxConsumers are the stream's settings (MaxConsumers -1: the server's default).
	MaxAge       time.Duration
	Replicas     int
	MaxConsumers int
	// Leader is the server leading the stream in a cluster ("" on a single server).
	Leader string
}

// Stream reports the state of a stream.
func (b *Bus) Stream(ctx context.Context, name string) (StreamInfo, error) {
	s, err := b.js.Stream(ctx, name)
	if err != nil {
		return StreamInfo{}, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return StreamInfo{}, fmt.Errorf("stream %s info: %w", name, err)
	}
	return StreamInfo{Name: name, Messages: info.State.Msgs, Bytes: info.State.Bytes,
		FirstSeq: info.State.FirstSeq, LastSeq: info.State.LastSeq, MaxAge: info.Config.MaxAge,
		Replicas: info.Config.Replicas, Leader: leader(info.Cluster), Consumers: info.State.Consumers,
		MaxConsumers: info.Config.MaxConsumers}, nil
}

// SubjectCounts returns how many messages stream holds on each subject matching filter (the server pages
// them; one entry per subject).
func (b *Bus) SubjectCounts(ctx context.Context, name, filter string) (map[string]uint64, error) {
	s, err := b.js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return nil, fmt.Errorf("stream %s subjects %s: %w", name, filter, err)
	}
	return info.State.Subjects, nil
}

func leader(c *jetstream.ClusterInfo) string {
	if c == nil {
		return ""
	}
	return c.Leader
}

// StreamNames lists every stream of the account (KV buckets are streams named KV_<bucket>).
func (b *Bus) StreamNames(ctx context.Context) ([]string, error) {
	var out []string
	l := b.js.StreamNames(ctx)
	for n := range l.Name() {
		out = append(out, n)
	}
	if err := l.Err(); err != nil {
		return out, fmt.Errorf("list streams: %w", err)
	}
	return out, nil
}

// SetStreamReplicas changes only the replica count of a stream (or of a bucket's KV_<bucket> stream),
// keeping the rest of its configuration: how an operator moves workers' R1 state onto every server of a
// cluster. It returns the replica count the stream had.
func (b *Bus) SetStreamReplicas(ctx context.Context, stream string, replicas int) (int, error) {
	s, err := b.js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s info: %w", stream, err)
	}
	cfg := info.Config
	old := cfg.Replicas
	if old == replicas {
		return old, nil
	}
	cfg.Replicas = replicas
	if _, err := b.js.UpdateStream(ctx, cfg); err != nil {
		return old, fmt.Errorf("set replicas of %s to %d: %w", stream, replicas, err)
	}
	return old, nil
}

// DeleteStream removes a stream with its messages and consumers: how an operator removes the legacy pull
// queue after an upgrade (docs/operations.md). A stream that does not exist is not an error.
func (b *Bus) DeleteStream(ctx context.Context, name string) error {
	if err := b.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("delete stream %s: %w", name, err)
	}
	return nil
}

// updateOrKeep updates a stream to sc; when the server refuses (another immutable setting, an identity
// without the right to update) the stream is kept as it is, and a warning says so.
func (b *Bus) updateOrKeep(ctx context.Context, sc jetstream.StreamConfig) {
	err := b.refusable(ctx, b.apiPrefix(sc.Name)+"STREAM.UPDATE."+sc.Name, func(ctx context.Context) error {
		_, err := b.js.UpdateStream(ctx, sc)
		return err
	})
	if err != nil {
		b.log.Warn("stream kept with its existing settings", "stream", sc.Name, "err", err)
	}
}
