package bus

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// EventMsg builds the NATS message of an event: JSON body, Nats-Msg-Id = event id, CloudEvents binary headers.
func EventMsg(ev events.Event) (*nats.Msg, error) {
	if err := ev.Validate(); err != nil {
		return nil, err
	}
	subject, err := ev.Subject()
	if err != nil {
		return nil, err
	}
	body, err := json.Marshal(ev)
	if err != nil {
		return nil, fmt.Errorf("marshal event %s: %w", ev.ID, err)
	}
	m := nats.NewMsg(subject)
	m.Data = body
	m.Header.Set(jetstream.MsgIDHeader, ev.ID)
	for k, v := range events.CloudEventHeader(ev.Type, ev.ID, ev.Node, ev.Time) {
		m.Header.Set(k, v)
	}
	return m, nil
}

// Publish stores an event in the events stream and waits for the server's ack. A retried publish of the same
// event is stored once (Nats-Msg-Id).
func (b *Bus) Publish(ctx context.Context, ev events.Event) error {
	m, err := EventMsg(ev)
	if err != nil {
		return err
	}
	if j := b.journal.Load(); j != nil {
		return j.publish(ctx, []events.Event{ev})
	}
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("publish %s %s: %w", ev.Type, ev.ID, b.explainPermission(m.Subject, err))
	}
	countPublished(ev.Type)
	return nil
}

// PublishAll publishes events asynchronously and waits for every ack; the first error is returned.
func (b *Bus) PublishAll(ctx context.Context, evs []events.Event) error {
	if j := b.journal.Load(); j != nil {
		for _, ev := range evs {
			if err := ev.Validate(); err != nil {
				return err
			}
		}
		return j.publish(ctx, evs)
	}
	futures := make([]jetstream.PubAckFuture, 0, len(evs))
	for _, ev := range evs {
		m, err := EventMsg(ev)
		if err != nil {
			return err
		}
		f, err := b.js.PublishMsgAsync(m)
		if err != nil {
			return fmt.Errorf("publish %s %s: %w", ev.Type, ev.ID, err)
		}
		futures = append(futures, f)
	}
	if err := waitAcks(ctx, futures); err != nil {
		return err
	}
	for _, ev := range evs {
		countPublished(ev.Type)
	}
	return nil
}

func waitAcks(ctx context.Context, futures []jetstream.PubAckFuture) error {
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return fmt.Errorf("publish %s: %w", f.Msg().Subject, err)
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
		return 0, fmt.Errorf("publish command to %s: %w", subject, b.explainPermission(subject, err))
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
