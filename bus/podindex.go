package bus

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// RawMsg is a message whose body is not an events.Event: pod events carry a plain core/v1 Pod and their
// envelope in CloudEvents binary-mode headers. MsgID, when set, becomes Nats-Msg-Id (a retried publish is
// stored once).
type RawMsg struct {
	Subject string
	MsgID   string
	Header  map[string]string
	Data    []byte
}

// natsMsg builds the message with its header values in one allocation (Header.Set makes one per value).
func (r RawMsg) natsMsg() *nats.Msg {
	n := len(r.Header) + 1
	h := make(nats.Header, n)
	vals := make([]string, 0, n)
	set := func(k, v string) {
		vals = append(vals, v)
		h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	for k, v := range r.Header {
		set(k, v)
	}
	if r.MsgID != "" {
		set(jetstream.MsgIDHeader, r.MsgID)
	}
	return &nats.Msg{Subject: r.Subject, Header: h, Data: r.Data}
}

// publishWindow bounds the acks PublishMsgs leaves outstanding (the client stalls past 4000).
const publishWindow = 1024

// PublishMsgs stores msgs in their stream (asynchronously, pipelined, at most publishWindow acks
// outstanding) and waits for every ack. It returns the highest stream sequence acknowledged (a duplicate's
// ack carries the original's sequence).
func (b *Bus) PublishMsgs(ctx context.Context, msgs []RawMsg) (uint64, error) {
	futures := make([]jetstream.PubAckFuture, 0, min(len(msgs), publishWindow))
	var last uint64
	wait := func(f jetstream.PubAckFuture) error {
		select {
		case ack := <-f.Ok():
			last = max(last, ack.Sequence)
			return nil
		case err := <-f.Err():
			return fmt.Errorf("publish %s: %w", f.Msg().Subject, err)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for i, r := range msgs {
		if i >= publishWindow {
			if err := wait(futures[i%publishWindow]); err != nil {
				return last, err
			}
		}
		f, err := b.publishAsyncRetry(ctx, r.natsMsg())
		if err != nil {
			return last, fmt.Errorf("publish to %s: %w", r.Subject, err)
		}
		if i < publishWindow {
			futures = append(futures, f)
		} else {
			futures[i%publishWindow] = f
		}
	}
	// The last len(futures) publishes, oldest first.
	n := len(futures)
	for k := range n {
		idx := k
		if len(msgs) > publishWindow {
			idx = (len(msgs) + k) % publishWindow
		}
		if err := wait(futures[idx]); err != nil {
			return last, err
		}
	}
	return last, nil
}

// publishAsyncRetry publishes asynchronously; when the connection's async window is full (other publishers
// share it), it waits for the window to drain instead of failing.
func (b *Bus) publishAsyncRetry(ctx context.Context, m *nats.Msg) (jetstream.PubAckFuture, error) {
	for {
		f, err := b.js.PublishMsgAsync(m)
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
			return f, err
		}
		select {
		case <-b.js.PublishAsyncComplete():
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Pending is a set of asynchronous publishes whose acks have not been awaited yet.
type Pending struct {
	futures []jetstream.PubAckFuture
}

// PublishAsync starts publishing events to the events stream without waiting for the acks; Wait waits.
func (b *Bus) PublishAsync(evs []events.Event) (*Pending, error) {
	p := &Pending{futures: make([]jetstream.PubAckFuture, 0, len(evs))}
	for _, ev := range evs {
		m, err := EventMsg(ev)
		if err != nil {
			return p, err
		}
		f, err := b.js.PublishMsgAsync(m)
		if err != nil {
			return p, fmt.Errorf("publish %s %s: %w", ev.Type, ev.ID, err)
		}
		p.futures = append(p.futures, f)
	}
	return p, nil
}

// Wait waits for every ack; the first error is returned.
func (p *Pending) Wait(ctx context.Context) error {
	if p == nil {
		return nil
	}
	return waitAcks(ctx, p.futures)
}

// DeadLetterMsg keeps m (read from stream by consumer) in the dead-letter stream with reason, exactly as a
// terminated message of Consume: consumers that track their own position (Tail) use it for poison messages.
// The dead letter's Nats-Msg-Id is <stream>-<seq>, so a replay dead-letters a message once.
func (b *Bus) DeadLetterMsg(ctx context.Context, stream, consumer string, m StreamMsg, reason error) error {
	dm := nats.NewMsg(events.DeadLetterPrefix + "." + stream + "." + consumer)
	dm.Data = m.Data
	dm.Header.Set(HeaderDLQSubject, m.Subject)
	dm.Header.Set(HeaderDLQReason, truncate(reason.Error(), 1024))
	dm.Header.Set(HeaderDLQDeliveries, "1")
	dm.Header.Set(HeaderDLQStreamSeq, strconv.FormatUint(m.Seq, 10))
	dm.Header.Set(HeaderDLQStream, stream)
	dm.Header.Set(jetstream.MsgIDHeader, stream+"-"+strconv.FormatUint(m.Seq, 10))
	if _, err := b.js.PublishMsg(ctx, dm); err != nil {
		return fmt.Errorf("dead letter %s seq %d: %w", m.Subject, m.Seq, err)
	}
	return nil
}

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
		if err := fn(sm); err != nil {
			return err
		}
	}
}
