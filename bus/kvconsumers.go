package bus

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// A key-value bucket is a stream (KV_<bucket>), and a bucket's stream takes the server's default limit of
// consumers, 1,000 on nats-server 2.15. Every node reads its own keys of the shared buckets with a watcher
// (an ordered consumer: the detector loading its image records, the pod index its snapshot), so a fleet
// starting more than a thousand agents at once had detectors refused with `maximum consumers limit reached`
// (err_code 10026; the 1,500-agent scale run). Buckets get the limit of the shared streams instead,
// events.SharedStreamMaxConsumers.

// RaiseBucketConsumers raises the consumer limit of bucket's stream to events.SharedStreamMaxConsumers
// when it is below it or unset (an unset limit, -1, is the server's default, 1,000, not "no limit"); a limit
// an operator raised further is kept. It needs the right to update streams: the client that creates a
// bucket (KV), or `imagefleet bus init` with the admin identity for buckets made with the server's limit
// (cmd/imagefleet/compat_kv_consumer_limits.go).
func (b *Bus) RaiseBucketConsumers(ctx context.Context, bucket string) error {
	name := "KV_" + bucket
	return b.retryTransient(ctx, "bucket "+bucket+" consumer limit", func(actx context.Context) error {
		s, err := b.js.Stream(actx, name)
		if err != nil {
			return fmt.Errorf("bucket %s: %w", bucket, err)
		}
		sc := s.CachedInfo().Config
		if enoughConsumers(sc.MaxConsumers, events.SharedStreamMaxConsumers) {
			return nil
		}
		sc.MaxConsumers = events.SharedStreamMaxConsumers
		return b.refusable(actx, b.apiPrefix(name)+"STREAM.UPDATE."+name, func(ctx context.Context) error {
			_, err := b.js.UpdateStream(ctx, sc)
			return err
		})
	})
}

// BucketNames lists the key-value buckets of this connection's domain(s).
func (b *Bus) BucketNames(ctx context.Context) ([]string, error) {
	var out []string
	l := b.js.KeyValueStoreNames(ctx)
	for n := range l.Name() {
		out = append(out, n)
	}
	if err := l.Error(); err != nil && err != jetstream.ErrEndOfData {
		return out, fmt.Errorf("list buckets: %w", err)
	}
	return out, nil
}
