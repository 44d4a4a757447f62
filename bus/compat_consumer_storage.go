// Compatibility path: a consumer made with the other storage.
//
// The server refuses to change a consumer's storage ("storage type can not be updated"). A durable that
// MemoryStorageWhenReplicated now makes in memory may exist with file storage: made by an earlier release,
// which made every node's pull consumer with files, or before its stream's replicas changed. It is kept as
// it is, and works as before; deleting it (`nats consumer rm <stream> <durable>` while its node's puller is
// stopped, or with no message waiting) has the next start make it with the storage its stream calls for.
//
// Remove when: no node's pull consumer made by a release before memory-storage node consumers is left
// (docs/upgrading.md, "Compatibility paths"); the case of replicas changed under a consumer then goes too.

package bus

import (
	"context"
	"errors"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// isStorageChange reports whether err is the server's refusal to change an existing consumer's storage.
func isStorageChange(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && strings.Contains(apiErr.Description, "storage type can not be updated")
}

// keepConsumerStorage makes cc, whose storage is the existing consumer's, and says so once (openConsumer
// remembers the storage).
func (b *Bus) keepConsumerStorage(ctx context.Context, cfg ConsumerConfig, cc jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	cons, err := b.js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc)
	if err == nil {
		storage := "file"
		if cc.MemoryStorage {
			storage = "memory"
		}
		b.log.Info("consumer keeps its storage: made so by an earlier release, or before its stream's replicas changed",
			"stream", cfg.Stream, "consumer", cfg.Durable, "storage", storage)
	}
	return cons, err
}
