package bus

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// openConsumer creates or updates the consumer cc on cfg.Stream, or with cfg.Bind only finds it.
// With cfg.MemoryStorageWhenReplicated it first reads the stream's replicas, the first time this Bus makes
// the consumer; later it makes it with the storage it had.
func (b *Bus) openConsumer(ctx context.Context, cfg ConsumerConfig, cc jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	if cfg.Bind {
		return b.js.Consumer(ctx, cfg.Stream, cfg.Durable)
	}
	if !cfg.MemoryStorageWhenReplicated {
		return b.js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc)
	}
	key := cfg.Stream + " " + cfg.Durable
	if memory, ok := b.consumerStorage.Load(key); ok {
		cc.MemoryStorage = memory.(bool)
	} else {
		s, err := b.js.Stream(ctx, cfg.Stream)
		if err != nil {
			return nil, err
		}
		cc.MemoryStorage = s.CachedInfo().Config.Replicas > 1
	}
	cons, err := b.js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc)
	if isStorageChange(err) {
		cc.MemoryStorage = !cc.MemoryStorage
		cons, err = b.keepConsumerStorage(ctx, cfg, cc) // compat_consumer_storage.go
	}
	if err == nil {
		b.consumerStorage.Store(key, cc.MemoryStorage)
	}
	return cons, err
}

// EnsureConsumer creates (or updates) the durable consumer cfg describes, with the settings Consume gives
// it, without consuming: for tools and benchmarks that make consumers as the workers do.
func (b *Bus) EnsureConsumer(ctx context.Context, cfg ConsumerConfig) error {
	cfg, cc := consumerSettings(cfg)
	cfg.Bind = false
	return b.retryTransient(ctx, "consumer "+cfg.Durable, func(actx context.Context) error {
		if _, err := b.openConsumer(actx, cfg, cc); err != nil {
			return fmt.Errorf("consumer %s on %s: %w", cfg.Durable, cfg.Stream, err)
		}
		return nil
	})
}

// IsStreamNotFound reports whether err says the stream does not exist.
func IsStreamNotFound(err error) bool { return errors.Is(err, jetstream.ErrStreamNotFound) }

// IsMaxConsumers reports whether err is the server's refusal of a consumer over its stream's, account's or
// server's consumer limit (JSMaximumConsumersLimitErr, 10026), from a consumer or from a key-value watcher
// (whose consumer nats.go's older JetStream API makes, with its own error type).
func IsMaxConsumers(err error) bool {
	var apiErr *jetstream.APIError
	var legacyErr *nats.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jsMaxConsumers ||
		errors.As(err, &legacyErr) && legacyErr.ErrorCode == nats.ErrorCode(jsMaxConsumers)
}

// jsMaxConsumers is the JetStream API error code "maximum consumers limit reached" (10026); nats.go names
// no constant for it.
const jsMaxConsumers jetstream.ErrorCode = 10026
