package bus

import (
	"context"
	"crypto/rand"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Tail delivers the messages of stream matching filter in stream order, from startSeq (0: the first), the
// stored ones then the new ones, to fn, until ctx ends (nil) or fn returns an error (returned as is). It uses
// an ordered consumer: no acks and no server-side state, the caller keeps its own position (the last
// sequence fn accepted) and resumes from it after an error or a restart. A connection error is returned
// (wrapped) so the caller resumes from its position.
func (b *Bus) Tail(ctx context.Context, stream, filter string, startSeq uint64, fn func(StreamMsg) error) error {
	return b.TailFrom(ctx, stream, filter, startSeq, nil, fn)
}

// TailFrom is Tail that first calls onStart (when not nil) with how many messages matching filter the
// stream held from startSeq on when the consumer was made: 0 means the reader is caught up before any
// message arrives. It is called again each time Tail is called, not when the ordered consumer is remade
// inside one call.
func (b *Bus) TailFrom(ctx context.Context, stream, filter string, startSeq uint64, onStart func(pending uint64), fn func(StreamMsg) error) error {
	occ := jetstream.OrderedConsumerConfig{}
	if filter != "" {
		occ.FilterSubjects = []string{filter}
	}
	if startSeq > 0 {
		occ.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		occ.OptStartSeq = startSeq
	}
	cons, err := b.js.OrderedConsumer(ctx, stream, occ)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("tail %s: %w", stream, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(2048))
	if err != nil {
		return fmt.Errorf("tail %s: %w", stream, err)
	}
	if onStart != nil {
		var pending uint64
		if info := cons.CachedInfo(); info != nil {
			pending = info.NumPending
		}
		onStart(pending)
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		select {
		case <-ctx.Done():
		case <-done:
		}
		it.Stop()
	}()
	defer func() {
		close(done)
		<-stopped
	}()
	for {
		jm, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("tail %s: %w", stream, err)
		}
		sm := StreamMsg{Subject: jm.Subject(), Header: jm.Headers(), Data: jm.Data()}
		if meta, mErr := jm.Metadata(); mErr == nil {
			sm.Seq, sm.Time, sm.Pending = meta.Sequence.Stream, meta.Timestamp, meta.NumPending
		}
		sm.Origin = originSeq(sm.Header.Get(headerStreamSource))
		if err := fn(sm); err != nil {
			return err
		}
	}
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
