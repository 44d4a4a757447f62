package fleet

import (
	"context"
	"errors"
	"time"

	"github.com/imagefleet/imagefleet/bus"
)

// retryTransient retries f while it fails with a transient bus error (a cluster server went away, a stream
// leader election), for up to 30 s. Every write it wraps is idempotent (Nats-Msg-Id). Each attempt gets its
// own context of at most bus.AttemptTimeout: a publish whose ack is lost with a killed server (the message
// stored, the ack routed through the dead server) would otherwise wait out the caller's whole deadline (a
// pre-pull's 90 s node timeout, CI's fleet test) instead of being sent again and answered as a duplicate.
func retryTransient(ctx context.Context, f func(attempt context.Context) error) error {
	return retryTransientFor(ctx, 30*time.Second, f)
}

// retryTransientFor is retryTransient retrying for up to maxElapsed.
func retryTransientFor(ctx context.Context, maxElapsed time.Duration, f func(attempt context.Context) error) error {
	deadline := time.Now().Add(maxElapsed)
	wait := 50 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, bus.AttemptTimeout)
		err := f(actx)
		cancel()
		if err == nil || !bus.IsTransient(err) || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}
