package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrPullQueueFull is wrapped by PublishPull when the node's pull queue already holds
// events.MaxPullRequestsPerNode requests: the stream refuses the message at once (DiscardNewPerSubject),
// so the caller gets backpressure instead of blocking, whatever the number of publishers or pullers.
var ErrPullQueueFull = errors.New("pull queue full")

// PublishPull stores a pull command like PublishCommand and maps the stream's per-subject limit to
// ErrPullQueueFull.
func (b *Bus) PublishPull(ctx context.Context, subject, msgID string, body any) (uint64, error) {
	seq, err := b.PublishCommand(ctx, subject, msgID, body, nil)
	if err != nil && strings.Contains(err.Error(), "maximum messages per subject exceeded") {
		return 0, fmt.Errorf("publish command to %s: %w", subject, ErrPullQueueFull)
	}
	return seq, err
}

// Subscription is a synchronous core NATS subscription: it is registered at the server when Subscribe
// returns, so a request published afterwards cannot race its answer.
type Subscription struct{ sub *nats.Subscription }

// SubscribeSync subscribes to subject (no queue group) and flushes, so the server knows the interest before
// the caller publishes anything.
func (b *Bus) SubscribeSync(ctx context.Context, subject string) (*Subscription, error) {
	sub, err := b.nc.SubscribeSync(subject)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subject, err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.nc.FlushWithContext(fctx); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("subscribe %s: flush: %w", subject, err)
	}
	return &Subscription{sub: sub}, nil
}

// Next waits for the next message until ctx ends.
func (s *Subscription) Next(ctx context.Context) (subject string, data []byte, err error) {
	m, err := s.sub.NextMsgWithContext(ctx)
	if err != nil {
		return "", nil, err
	}
	return m.Subject, m.Data, nil
}

// Close unsubscribes.
func (s *Subscription) Close() { _ = s.sub.Unsubscribe() }

// ConsumerState is what tests and operators want to see of a durable consumer.
type ConsumerState struct {
	// NumPending: stored, not yet delivered. NumAckPending: delivered, not yet acked (in flight).
	NumPending, NumAckPending, NumRedelivered int
	MaxAckPending                             int
	// NumWaiting is how many pull requests of its subscribers the server holds (0 while nobody pulls).
	NumWaiting int
	// Leader is the server leading the consumer in a cluster ("" on a single server).
	Leader string
}

// Consumer reports the state of a durable consumer.
func (b *Bus) Consumer(ctx context.Context, stream, durable string) (ConsumerState, error) {
	c, err := b.js.Consumer(ctx, stream, durable)
	if err != nil {
		return ConsumerState{}, fmt.Errorf("consumer %s on %s: %w", durable, stream, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return ConsumerState{}, fmt.Errorf("consumer %s on %s info: %w", durable, stream, err)
	}
	return ConsumerState{NumPending: int(info.NumPending), NumAckPending: info.NumAckPending,
		NumRedelivered: info.NumRedelivered, MaxAckPending: info.Config.MaxAckPending, NumWaiting: info.NumWaiting,
		Leader: leader(info.Cluster)}, nil
}

// IsConsumerNotFound reports whether err says the consumer does not exist.
func IsConsumerNotFound(err error) bool { return errors.Is(err, jetstream.ErrConsumerNotFound) }
