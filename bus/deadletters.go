package bus

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// ErrNoDeadLetter is returned by ReplayDeadLetter when the dead-letter stream has no message at seq.
var ErrNoDeadLetter = errors.New("no such dead letter")

// Replayed says where a replayed dead letter went.
type Replayed struct {
	Subject string `json:"subject"`
	// Stream and Seq are set when the subject belongs to a stream (the message was stored again).
	Stream string `json:"stream,omitempty"`
	Seq    uint64 `json:"seq,omitempty"`
	// Duplicate: the stream already had this replay (same dead letter replayed within the duplicate window).
	Duplicate bool `json:"duplicate,omitempty"`
}

// ReplayDeadLetter publishes the dead letter at seq of the dead-letter stream again to its original subject,
// with its original headers, through JetStream when a stream captures the subject (its Nats-Msg-Id is
// "replay-<seq>", so replaying the same dead letter twice in the duplicate window stores it once), else as a
// core message. With remove, the dead letter is deleted after a successful replay.
func (b *Bus) ReplayDeadLetter(ctx context.Context, seq uint64, remove bool) (Replayed, error) {
	s, err := b.js.Stream(ctx, events.DeadLetterStream)
	if err != nil {
		return Replayed{}, fmt.Errorf("replay dead letter %d: %w", seq, err)
	}
	raw, err := s.GetMsg(ctx, seq)
	if err != nil {
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return Replayed{}, fmt.Errorf("replay dead letter %d: %w", seq, ErrNoDeadLetter)
		}
		return Replayed{}, fmt.Errorf("replay dead letter %d: %w", seq, err)
	}
	subject := raw.Header.Get(HeaderDLQSubject)
	if subject == "" {
		return Replayed{}, fmt.Errorf("replay dead letter %d: it has no %s header", seq, HeaderDLQSubject)
	}
	m := nats.NewMsg(subject)
	m.Data = raw.Data
	for k, vs := range raw.Header {
		if strings.HasPrefix(k, "Imagefleet-") || k == jetstream.MsgIDHeader {
			continue
		}
		for _, v := range vs {
			m.Header.Add(k, v)
		}
	}
	m.Header.Set(jetstream.MsgIDHeader, "replay-"+strconv.FormatUint(seq, 10))
	out := Replayed{Subject: subject}
	ack, err := b.js.PublishMsg(ctx, m)
	switch {
	case err == nil:
		out.Stream, out.Seq, out.Duplicate = ack.Stream, ack.Sequence, ack.Duplicate
	case errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders):
		// No stream captures the subject: a core request/reply or signal subject.
		m.Header.Del(jetstream.MsgIDHeader)
		if err := b.nc.PublishMsg(m); err != nil {
			return Replayed{}, fmt.Errorf("replay dead letter %d to %s: %w", seq, subject, err)
		}
	default:
		return Replayed{}, fmt.Errorf("replay dead letter %d to %s: %w", seq, subject, b.explainPermission(subject, err))
	}
	if remove {
		if err := s.DeleteMsg(ctx, seq); err != nil {
			return out, fmt.Errorf("delete dead letter %d after replay: %w", seq, err)
		}
	}
	return out, nil
}

// DeadLetterMsg keeps m (read from stream by consumer) in the dead-letter stream with reason, exactly as a
// terminated message of Consume: consumers that track their own position (Read) use it for poison messages.
// The dead letter's Nats-Msg-Id is <stream>-<seq>, so a replay dead-letters a message once.
func (b *Bus) DeadLetterMsg(ctx context.Context, stream, consumer string, m StreamMsg, reason error) error {
	dm := deadLetterMsg(stream, consumer, m.Subject, m.Header, m.Data, 1, m.Seq, reason)
	if _, err := b.js.PublishMsg(ctx, dm); err != nil {
		return fmt.Errorf("dead letter %s seq %d: %w", m.Subject, m.Seq, err)
	}
	deadLetters.WithLabelValues(consumer).Inc()
	return nil
}

// deadLetterMsg is the dead letter of a message of stream (at seq) that consumer gave up on after
// deliveries: its body and every header it had (CloudEvents attributes, ...) but the server's sourcing one, so a replay puts back the same
// message, plus the Imagefleet-* headers saying where it came from and why. Every dead letter is made here.
func deadLetterMsg(stream, consumer, subject string, header nats.Header, data []byte, deliveries, seq uint64, reason error) *nats.Msg {
	dm := nats.NewMsg(events.DeadLetterPrefix + "." + stream + "." + consumer)
	dm.Data = data
	for k, vs := range header {
		// The header the server adds to a message it copies into a sourcing stream (IMAGEFLEET_PODS) is not
		// the message's own: a replay publishes to the origin stream, which refuses it.
		if k == headerStreamSource {
			continue
		}
		dm.Header[k] = append([]string(nil), vs...)
	}
	dm.Header.Set(HeaderDLQSubject, subject)
	dm.Header.Set(HeaderDLQReason, truncate(reason.Error(), 1024))
	dm.Header.Set(HeaderDLQDeliveries, strconv.FormatUint(deliveries, 10))
	dm.Header.Set(HeaderDLQStreamSeq, strconv.FormatUint(seq, 10))
	dm.Header.Set(HeaderDLQStream, stream)
	dm.Header.Set(jetstream.MsgIDHeader, stream+"-"+strconv.FormatUint(seq, 10))
	return dm
}

// DeadLetter is one message kept in the dead-letter stream.
type DeadLetter struct {
	Seq        uint64    `json:"seq"`
	Consumer   string    `json:"consumer"`
	Subject    string    `json:"subject"`
	Reason     string    `json:"reason"`
	Deliveries string    `json:"deliveries"`
	Time       time.Time `json:"time"`
	Data       []byte    `json:"data"`
}

// DeadLetters lists dead letters (filter "" for all) in stream order.
func (b *Bus) DeadLetters(ctx context.Context, filter string) ([]DeadLetter, error) {
	subj := events.DeadLetterPrefix + ".>"
	if filter != "" {
		subj = filter
	}
	var out []DeadLetter
	err := b.Read(ctx, events.DeadLetterStream, subj, func(m StreamMsg) error {
		out = append(out, DeadLetter{Seq: m.Seq, Consumer: m.Subject, Subject: m.Header.Get(HeaderDLQSubject),
			Reason: m.Header.Get(HeaderDLQReason), Deliveries: m.Header.Get(HeaderDLQDeliveries), Time: m.Time, Data: m.Data})
		return nil
	})
	return out, err
}
