package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// EventMsg builds the NATS message of an event as its type's version writes it (events.EncodeEvent):
// the body and CloudEvents binary headers, Nats-Msg-Id = event id.
func EventMsg(ev events.Event) (*nats.Msg, error) {
	subject, err := ev.Subject()
	if err != nil {
		return nil, err
	}
	header, body, err := events.EncodeEvent(ev)
	if err != nil {
		return nil, err
	}
	m := nats.NewMsg(subject)
	m.Data = body
	m.Header.Set(jetstream.MsgIDHeader, ev.ID)
	for k, v := range header {
		m.Header.Set(k, v)
	}
	return m, nil
}

// SetEventVersion sets the type version the bus writes events in (events.V1, the default, or events.V2):
// PublishAll converts each v1 event to it before it is journaled and sent. See docs/events.md for the
// upgrade order.
func (b *Bus) SetEventVersion(version string) error {
	v, err := events.ParseEventVersion(version)
	if err != nil {
		return err
	}
	b.eventVersion.Store(&v)
	return nil
}

// writeVersion converts ev to the bus's writer version.
func (b *Bus) writeVersion(ev events.Event) (events.Event, error) {
	v := b.eventVersion.Load()
	if v == nil || *v == ev.Version() || ev.Version() != events.V1 {
		return ev, nil
	}
	return ev.AsVersion(*v)
}

// PublishOpt is an option of Publish and PublishAll (as nats.go's jetstream.PublishOpt).
type PublishOpt func(*publishOpts)

type publishOpts struct {
	pending *Pending
}

// Async makes the publish return as soon as the events are handed over, and sets *pending to what
// pending.Wait waits on. With a journal (OpenJournal) the events are journaled and the journal's sender
// publishes them: Wait returns nil at once, the journal owns them. Without one they are sent without
// waiting for the acks: Wait waits for them, and counts the events it sees acked.
func Async(pending *Pending) PublishOpt { return func(o *publishOpts) { o.pending = pending } }

// Publish stores an event in the events stream and waits for the server's ack (see PublishAll).
func (b *Bus) Publish(ctx context.Context, ev events.Event, opts ...PublishOpt) error {
	return b.PublishAll(ctx, []events.Event{ev}, opts...)
}

// PublishAll is the one publish path of events: each is validated, then journaled when the bus has a
// journal (nil then means journaled: sent and acked when NATS is reachable, resent later when not), or
// published asynchronously; it waits for every ack (unless Async) and returns the first error. Every event
// stored is counted in imagefleet_bus_events_published_total by its type. A retried publish of the same
// event is stored once (Nats-Msg-Id = event id).
func (b *Bus) PublishAll(ctx context.Context, evs []events.Event, opts ...PublishOpt) error {
	var o publishOpts
	for _, opt := range opts {
		opt(&o)
	}
	msgs := make([]*nats.Msg, len(evs))
	if v := b.eventVersion.Load(); v != nil && *v != events.V1 {
		evs = slices.Clone(evs) // the caller's events stay as they were
		for i, ev := range evs {
			var err error
			if evs[i], err = b.writeVersion(ev); err != nil {
				return err
			}
		}
	}
	for i, ev := range evs {
		m, err := EventMsg(ev)
		if err != nil {
			return err
		}
		msgs[i] = m
	}
	if j := b.journal.Load(); j != nil {
		if o.pending != nil {
			*o.pending = Pending{}
			return j.Enqueue(evs)
		}
		return j.Publish(ctx, evs)
	}
	if len(msgs) == 1 && o.pending == nil {
		if _, err := b.js.PublishMsg(ctx, msgs[0]); err != nil {
			return fmt.Errorf("publish %s %s: %w", evs[0].Type, evs[0].ID, b.explainPermission(msgs[0].Subject, err))
		}
		countPublished(evs[0].Type)
		return nil
	}
	p := Pending{b: b, futures: make([]jetstream.PubAckFuture, 0, len(msgs)), types: make([]string, 0, len(msgs))}
	for i, m := range msgs {
		f, err := b.publishAsyncRetry(ctx, m)
		if err != nil {
			return fmt.Errorf("publish %s %s: %w", evs[i].Type, evs[i].ID, b.explainPermission(m.Subject, err))
		}
		p.futures = append(p.futures, f)
		p.types = append(p.types, evs[i].Type)
	}
	if o.pending != nil {
		*o.pending = p
		return nil
	}
	return p.Wait(ctx)
}

// Pending is a set of asynchronous publishes whose acks have not been awaited yet (see Async).
type Pending struct {
	b       *Bus
	futures []jetstream.PubAckFuture
	types   []string // the event type of each future
	counted int      // futures already seen acked and counted
}

// Wait waits for every ack and counts the events acked; the first error is returned.
func (p *Pending) Wait(ctx context.Context) error {
	if p == nil {
		return nil
	}
	for ; p.counted < len(p.futures); p.counted++ {
		f := p.futures[p.counted]
		select {
		case <-f.Ok():
			countPublished(p.types[p.counted])
		case err := <-f.Err():
			return fmt.Errorf("publish %s: %w", f.Msg().Subject, p.b.explainPermission(f.Msg().Subject, err))
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// PublishCommand stores a command in a JetStream stream (the pull work queue) with msgID for de-duplication.
// Headers are optional extra headers.
func (b *Bus) PublishCommand(ctx context.Context, subject, msgID string, body any, headers map[string]string) (uint64, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return 0, fmt.Errorf("marshal command for %s: %w", subject, err)
	}
	m := nats.NewMsg(subject)
	m.Data = data
	if msgID != "" {
		m.Header.Set(jetstream.MsgIDHeader, msgID)
	}
	for k, v := range headers {
		m.Header.Set(k, v)
	}
	ack, err := b.js.PublishMsg(ctx, m)
	if err != nil {
		return 0, fmt.Errorf("publish command to %s: %w", subject, b.explainPermission(subject, mapJetStream(err)))
	}
	return ack.Sequence, nil
}

// PublishRaw sends a core NATS message (no JetStream), for fire-and-forget signals such as heartbeats.
func (b *Bus) PublishRaw(subject string, data []byte) error {
	if err := b.nc.Publish(subject, data); err != nil {
		return fmt.Errorf("publish to %s: %w", subject, err)
	}
	return nil
}

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

// PublishFirst stores msg in its stream only if its subject holds no message yet (the server checks it:
// Nats-Expected-Last-Subject-Sequence 0). It returns true when msg was stored, or when a retry of the same
// msg (same MsgID, within the stream's duplicate window) finds it stored; false when another message holds
// the subject. Two writers racing for one subject: exactly one gets true.
func (b *Bus) PublishFirst(ctx context.Context, msg RawMsg) (bool, error) {
	m := msg.natsMsg()
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		if isWrongLastSeq(err) {
			return false, nil
		}
		return false, fmt.Errorf("publish first to %s: %w", msg.Subject, err)
	}
	return true, nil
}

// PublishStored stores msg in its stream and waits for the ack (one message; see PublishMsgs for many).
func (b *Bus) PublishStored(ctx context.Context, msg RawMsg) (uint64, error) {
	ack, err := b.js.PublishMsg(ctx, msg.natsMsg())
	if err != nil {
		return 0, fmt.Errorf("publish to %s: %w", msg.Subject, err)
	}
	return ack.Sequence, nil
}
