package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Follow delivers stored then new messages of stream matching filter from startSeq (0: the first; use
// DeliverNew semantics with startSeq = ^uint64(0)) until fn returns false or ctx ends.
func (b *Bus) Follow(ctx context.Context, stream, filter string, startSeq uint64, fn func(StreamMsg) bool) error {
	err := b.follow(ctx, stream, filter, startSeq, 0, fn)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

func (b *Bus) follow(ctx context.Context, stream, filter string, startSeq, stopSeq uint64, fn func(StreamMsg) bool) error {
	occ := jetstream.OrderedConsumerConfig{}
	if filter != "" {
		occ.FilterSubjects = []string{filter}
	}
	switch {
	case startSeq == ^uint64(0):
		occ.DeliverPolicy = jetstream.DeliverNewPolicy
	case startSeq > 0:
		occ.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		occ.OptStartSeq = startSeq
	}
	// The context bounds only the consumer's creation (nats.go keeps none of it), so each attempt gets its
	// own: a create whose reply was lost with a server is asked again after AttemptTimeout instead of
	// holding the caller until its deadline (seen: a rollout's records unreadable for a minute after a kill).
	var cons jetstream.Consumer
	err := b.retryTransientFor(ctx, "read "+stream, kvRetryFor, func(actx context.Context) (err error) {
		cons, err = b.js.OrderedConsumer(actx, stream, occ)
		return err
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", stream, err)
	}
	// A fetch that fails transiently (the server it went to was lost, the stream elects a leader: "no
	// responders") is tried again, the ordered consumer going on after the last message delivered, for up to
	// kvRetryFor without progress.
	var failingSince time.Time
	retry := func(err error) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !IsTransient(err) || errors.Is(err, nats.ErrConnectionClosed) {
			return fmt.Errorf("read %s: %w", stream, err)
		}
		if failingSince.IsZero() {
			failingSince = time.Now()
		}
		if time.Since(failingSince) > kvRetryFor {
			return fmt.Errorf("read %s: failing for %s: %w", stream, kvRetryFor, err)
		}
		b.log.Warn("NATS not ready; retrying", "what", "read "+stream, "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		return nil
	}
	for {
		fctx := ctx
		var cancel context.CancelFunc = func() {}
		if stopSeq > 0 {
			fctx, cancel = context.WithTimeout(ctx, 2*time.Second)
		}
		batch, err := cons.Fetch(500, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			if rerr := retry(err); rerr != nil {
				return rerr
			}
			continue
		}
		n := 0
		for jm := range batch.Messages() {
			n++
			meta, _ := jm.Metadata()
			sm := StreamMsg{Subject: jm.Subject(), Header: jm.Headers(), Data: jm.Data()}
			if meta != nil {
				sm.Seq, sm.Time = meta.Sequence.Stream, meta.Timestamp
			}
			if !fn(sm) {
				cancel()
				return nil
			}
			if stopSeq > 0 && sm.Seq >= stopSeq {
				cancel()
				return nil
			}
			if meta != nil && meta.NumPending == 0 && stopSeq > 0 {
				cancel()
				return nil
			}
		}
		cancel()
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			if rerr := retry(err); rerr != nil {
				return rerr
			}
			continue
		}
		failingSince = time.Time{}
		if n == 0 && stopSeq > 0 {
			return nil
		}
	}
}
