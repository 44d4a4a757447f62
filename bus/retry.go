package bus

import (
	"context"
	"errors"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// IsTransient reports whether err is a connection or JetStream availability problem that a retry after a
// moment can fix (a server of the cluster went away, a stream leader is being elected).
func IsTransient(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		unavailable(err) || duplicateInProcess(err)
}

// duplicateInProcess: the stream leader still has a message with the same Nats-Msg-Id in flight (10158,
// "duplicate message id is in process"): an earlier attempt whose ack is late. A retry after a moment is
// answered as a duplicate once that attempt is stored, or stored itself if it was dropped.
func duplicateInProcess(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeDuplicateInProcess
}

// jsErrCodeDuplicateInProcess is nats-server's JSStreamDuplicateMessageConflict (nats.go has no name for it).
const jsErrCodeDuplicateInProcess jetstream.ErrorCode = 10158

// unavailable: the server answered "JetStream system temporarily unavailable" or "no suitable peers"
// (503, while a cluster elects its leaders or lacks the servers a replicated stream needs).
func unavailable(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.Code == 503
}

// retryTransient runs op until it succeeds, fails for good, or ctx ends: a transient failure (IsTransient,
// not a permissions violation) is retried with exponential backoff (cenkalti, 250 ms to 5 s) and logged, so
// a worker starting while a cluster elects its leaders waits for it instead of exiting.
func (b *Bus) retryTransient(ctx context.Context, what string, op func(attempt context.Context) error) error {
	return b.retryTransientFor(ctx, what, 0, op)
}

// AttemptTimeout bounds one attempt of a retried call (the JetStream API's own default): a caller's long
// deadline (a command's --timeout) leaves room for retries instead of one attempt waiting all of it.
const AttemptTimeout = 5 * time.Second

// kvRetryFor bounds the retries of one key-value operation: a cluster that lost a server elects new stream
// leaders within seconds; past this the caller hears of the failure.
const kvRetryFor = 20 * time.Second

// retryTransientFor is retryTransient giving up after maxElapsed (0: only when ctx ends).
// op gets a context for the attempt (ctx bounded by AttemptTimeout); what must outlive the attempt (a
// watcher, a consumer's iterator) is made with ctx instead.
func (b *Bus) retryTransientFor(ctx context.Context, what string, maxElapsed time.Duration, op func(attempt context.Context) error) error {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 250 * time.Millisecond
	bo.MaxInterval = 5 * time.Second
	bo.MaxElapsedTime = maxElapsed
	attempt := 0
	return backoff.Retry(func() error {
		actx, cancel := context.WithTimeout(ctx, AttemptTimeout)
		err := op(actx)
		cancel()
		// A closed connection (Close was called) never comes back: not worth a retry.
		if err == nil || ctx.Err() != nil || errors.Is(err, ErrPermissionViolation) || !IsTransient(err) ||
			errors.Is(err, nats.ErrConnectionClosed) || b.nc.IsClosed() {
			if err != nil {
				return backoff.Permanent(err)
			}
			return nil
		}
		attempt++
		b.log.Warn("NATS not ready; retrying", "what", what, "attempt", attempt, "err", err)
		return err
	}, backoff.WithContext(bo, ctx))
}
