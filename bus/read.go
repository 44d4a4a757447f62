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
	// Pending is, for a message Read delivered, how many messages matching its filter followed it in the
	// stream when it was delivered (the reader's backlog then); 0 elsewhere.
	Pending uint64
	// Origin is, for a message Read delivered from a stream that sources another, its sequence in the stream
	// it was copied from (the server's Nats-Stream-Source header); 0 when the message was not sourced.
	Origin uint64
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
