package bus

import (
	"context"
	"crypto/rand"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Tail delivers the messages of stream matching filter in stream order, from startSeq (0: the first), the
// stored ones then the new ones, to fn, until ctx ends (nil) or fn returns an error (returned as is). It reads
// with an ordered consumer: no acks and no server-side state, the caller keeps its own position (the last
// sequence fn accepted) and resumes from it after an error or a restart. A closed connection is returned
// (wrapped) so the caller resumes from its position.
func (b *Bus) Tail(ctx context.Context, stream, filter string, startSeq uint64, fn func(StreamMsg) error) error {
	return b.TailFrom(ctx, stream, filter, startSeq, nil, fn)
}

// tailWindow is how many messages Tail asks for ahead of fn (what it asked of nats.go's iterator).
const tailWindow = 2048

// tailInactive is how long the server keeps a Tail's consumer that nobody pulls from (nats.go's ordered
// consumer's): the consumers a reader leaves behind (one made anew, one of a Tail that returned) go then; a
// node may make them, not delete them.
const tailInactive = 5 * time.Minute

// TailFrom is Tail that first calls onStart (when not nil) with how many messages matching filter the
// stream held from startSeq on when the consumer was made: 0 means the reader is caught up before any
// message arrives. It is called again each time Tail is called, not when the ordered consumer is remade
// inside one call.
//
// The reader pulls with the loop Consume uses (pullLoop), its consumer made anew when a delivery skips a
// message or no server takes its requests: nats.go's iterator (Messages) lost pull requests as it did for
// Consume, and noticed only after two missed 5 s heartbeats, or when the stream's next message showed the
// gap; here a lost request is sent again within 2 s (TestTailNoticesALostPull).
func (b *Bus) TailFrom(ctx context.Context, stream, filter string, startSeq uint64, onStart func(pending uint64), fn func(StreamMsg) error) error {
	name := "tail:" + stream
	initLostPullMetrics(name)
	l := b.newPullLoop("tail "+stream, name, stream, tailWindow, 1)
	l.log = l.log.With("filter", filter)
	l.ordered = true
	l.closedErr = fmt.Errorf("tail %s: %w", stream, nats.ErrConnectionClosed)
	l.open = func(ctx context.Context, from uint64) (jetstream.Consumer, error) {
		cc := jetstream.ConsumerConfig{
			Name:              "tail_" + rand.Text(),
			DeliverPolicy:     jetstream.DeliverAllPolicy,
			AckPolicy:         jetstream.AckNonePolicy,
			InactiveThreshold: tailInactive,
			Replicas:          1,
			MemoryStorage:     true,
			FilterSubject:     filter,
		}
		if from == 0 {
			from = startSeq
		}
		if from > 0 {
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from
		}
		var cons jetstream.Consumer
		err := b.retryTransient(ctx, "tail "+stream, func(actx context.Context) (err error) {
			cons, err = b.js.CreateConsumer(actx, stream, cc)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("tail %s: %w", stream, err)
		}
		return cons, nil
	}
	l.handle = func(_ context.Context, d *delivery) error {
		return fn(StreamMsg{Subject: d.m.Subject, Header: d.m.Header, Data: d.m.Data, Seq: d.streamSeq, Time: d.time,
			Pending: d.pending, Origin: originSeq(d.m.Header.Get(headerStreamSource))})
	}
	cons, err := l.open(ctx, 0)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	if onStart != nil {
		onStart(cons.CachedInfo().NumPending)
	}
	l.use(cons)
	return l.run(ctx)
}

// headerStreamSource is the header the server adds to a message it copies into a stream that sources
// another: "<stream> <seq> <filter> <transform>".
const headerStreamSource = "Nats-Stream-Source"

// originSeq is the origin stream's sequence in a Nats-Stream-Source header ("<stream> <seq> <filter>
// <transform> ..."), 0 when there is none.
func originSeq(h string) uint64 {
	f := strings.Fields(h)
	if len(f) < 2 {
		return 0
	}
	n, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// CountPending is how many messages of stream matching filter it holds from startSeq (0: the first) on. It
// makes a consumer that delivers nothing and is left to expire (a node identity may create consumers with
// its own filter, not delete them).
func (b *Bus) CountPending(ctx context.Context, stream, filter string, startSeq uint64) (uint64, error) {
	cc := jetstream.ConsumerConfig{
		Name:              "count-" + rand.Text(),
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		InactiveThreshold: 5 * time.Second,
		FilterSubject:     filter,
	}
	if startSeq > 0 {
		cc.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cc.OptStartSeq = startSeq
	}
	c, err := b.js.CreateConsumer(ctx, stream, cc)
	if err != nil {
		return 0, fmt.Errorf("count %s in %s: %w", filter, stream, err)
	}
	return c.CachedInfo().NumPending, nil
}
