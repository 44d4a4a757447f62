package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// StreamMsg is a message read from a stream.
type StreamMsg struct {
	Subject string
	Seq     uint64
	Time    time.Time
	Header  nats.Header
	Data    []byte
	// Pending is, for a message read by Tail, how many messages matching its filter followed it in the
	// stream when it was delivered (the reader's backlog then); 0 elsewhere.
	Pending uint64
	// Origin is, for a message read by Tail from a stream that sources another, its sequence in the stream
	// it was copied from (the server's Nats-Stream-Source header); 0 when the message was not sourced.
	Origin uint64
}

// ReadStream reads the stored messages of stream matching filter from startSeq (0: the first) and calls fn
// for each until fn returns false or the end of the stream (as of the call) is reached.
func (b *Bus) ReadStream(ctx context.Context, stream, filter string, startSeq uint64, fn func(StreamMsg) bool) error {
	var info *jetstream.StreamInfo
	err := b.retryTransientFor(ctx, "stream "+stream, kvRetryFor, func(actx context.Context) error {
		s, err := b.js.Stream(actx, stream)
		if err != nil {
			return fmt.Errorf("stream %s: %w", stream, err)
		}
		info, err = s.Info(actx)
		if err != nil {
			return fmt.Errorf("stream %s info: %w", stream, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if info.State.Msgs == 0 {
		return nil
	}
	return b.follow(ctx, stream, filter, startSeq, info.State.LastSeq, fn)
}

// ErrNoMessage is returned by LastMsg when no message of the stream has the subject.
var ErrNoMessage = errors.New("no message")

// LastMsg returns the last message of stream stored on subject (a direct lookup, no consumer), or an error
// wrapping ErrNoMessage.
func (b *Bus) LastMsg(ctx context.Context, stream, subject string) (StreamMsg, error) {
	s, err := b.js.Stream(ctx, stream)
	if err != nil {
		return StreamMsg{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, subject)
	if err != nil {
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return StreamMsg{}, fmt.Errorf("last message on %s: %w", subject, ErrNoMessage)
		}
		return StreamMsg{}, fmt.Errorf("last message on %s: %w", subject, err)
	}
	return StreamMsg{Subject: m.Subject, Seq: m.Sequence, Time: m.Time, Header: m.Header, Data: m.Data}, nil
}
