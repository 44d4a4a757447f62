package bus

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// Range calls fn for every live entry whose key matches filter (a NATS subject filter over keys, ">" for all),
// in the bucket's storage order, without holding them: the server filters by key, the caller by anything
// else, and memory stays that of one entry. fn returning false stops the range early.
func (k *KV) Range(ctx context.Context, filter string, fn func(Entry) bool) error {
	if filter == "" {
		filter = ">"
	}
	var w jetstream.KeyWatcher
	err := k.b.retryTransientFor(ctx, "kv range "+k.kv.Bucket(), kvRetryFor, func(context.Context) (err error) {
		w, err = k.kv.Watch(ctx, filter, jetstream.IgnoreDeletes())
		return err
	})
	if err != nil {
		return fmt.Errorf("kv range %s/%s: %w", k.kv.Bucket(), filter, err)
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case e, ok := <-w.Updates():
			if !ok || e == nil { // closed, or the end of the initial values
				return nil
			}
			if !fn(Entry{Key: e.Key(), Value: e.Value(), Revision: e.Revision(), Created: e.Created()}) {
				return nil
			}
		}
	}
}

// DeleteIf removes key only if its latest revision is still rev (compare and delete); otherwise it returns an
// error wrapping ErrConflict.
func (k *KV) DeleteIf(ctx context.Context, key string, rev uint64) error {
	err := k.kv.Delete(ctx, key, jetstream.LastRevision(rev))
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) || isWrongLastSeq(err) {
			return fmt.Errorf("kv delete %s/%s: %w", k.kv.Bucket(), key, ErrConflict)
		}
		return fmt.Errorf("kv delete %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return nil
}
