package bus

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// IsTransient reports whether err is a connection or JetStream availability problem that a retry after a
// moment can fix (a server of the cluster went away, a stream leader is being elected). A key-value watcher's
// consumer is made by nats.go's older JetStream API, whose errors are its own types: a create request no
// server took is its ErrJetStreamNotEnabled, a 503 its APIError; both count as they do from the newer one.
func IsTransient(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, nats.ErrJetStreamNotEnabled) || unavailable(err) || duplicateInProcess(err)
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
	var legacyErr *nats.APIError
	return errors.As(err, &apiErr) && apiErr.Code == 503 || errors.As(err, &legacyErr) && legacyErr.Code == 503
}

// retryTransient runs op until it succeeds, fails for good, or ctx ends: a transient failure (IsTransient,
// not a permissions violation) is retried on RetryWait's schedule (up to maxRetryWait apart) and logged, so
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

// ElectionWindow is how long after losing a server a cluster takes to have every stream, bucket and its
// JetStream API led again: nats-server's raft elects a new leader when a follower has not heard from the
// old one for its election timeout (drawn from 4-9 s), and the vote takes milliseconds.
const ElectionWindow = 10 * time.Second

// Retry waits (RetryWait): electionRetryWait (jittered) within the ElectionWindow, then growing from
// afterElectionRetryWait; maxRetryWait is the longest wait of the bus's own retries (retryTransientFor).
const (
	electionRetryWait      = 250 * time.Millisecond
	afterElectionRetryWait = 500 * time.Millisecond
	maxRetryWait           = 5 * time.Second
)

// RetryWait is the wait before the next attempt of a call that has failed transiently (IsTransient) for
// failingFor, prev being the wait before the attempt that just failed (0 after the first attempt).
//
// Within the ElectionWindow it is 200-300 ms. A call fails there because a leader is being elected, and its
// attempts fail at once (no responders: the stream has no leader) or after the ack of the one attempt sent
// to the lost leader timed out; attempts this close cost little, and the call uses the new leader within a
// fraction of a second of its election. A wait doubling from 250 ms (to 2 s in the detector, 5 s here) left
// the call idle for seconds after it: a detector answered its detect command 10.4 s after the loss, its
// bucket's leader elected 8.7 s after it.
//
// Past the window the cluster lost more than a leader (its quorum, or every server): each wait is drawn
// between the last one and twice it (at least 250-500 ms, at most ceiling/2-ceiling), so the calls back off
// and the nodes of a fleet do not all come back at once.
func RetryWait(failingFor, prev, ceiling time.Duration) time.Duration {
	if failingFor < ElectionWindow {
		return electionRetryWait*4/5 + rand.N(electionRetryWait*2/5)
	}
	d := min(max(2*prev, afterElectionRetryWait), ceiling)
	return d/2 + rand.N(d/2+1)
}

// retryBackOff is RetryWait (up to ceiling) as a cenkalti BackOff: it stops when the next attempt would start
// past maxElapsed (0: never).
type retryBackOff struct {
	start      time.Time
	prev       time.Duration
	maxElapsed time.Duration
	ceiling    time.Duration
}

func (r *retryBackOff) Reset() { r.start, r.prev = time.Now(), 0 }

func (r *retryBackOff) NextBackOff() time.Duration {
	elapsed := time.Since(r.start)
	r.prev = RetryWait(elapsed, r.prev, r.ceiling)
	if r.maxElapsed > 0 && elapsed+r.prev > r.maxElapsed {
		return backoff.Stop
	}
	return r.prev
}

// RetryOption configures Retry.
type RetryOption func(*retryConfig)

type retryConfig struct {
	maxElapsed, perAttempt, maxWait time.Duration
	patient                         bool
	log                             *slog.Logger
	what                            string
	closed                          func() bool
}

// MaxElapsed has Retry give up when the next attempt would start more than d after the first (the last
// attempt's error is returned); 0, the default, retries until ctx ends.
func MaxElapsed(d time.Duration) RetryOption { return func(c *retryConfig) { c.maxElapsed = d } }

// PerAttempt bounds each attempt: op's context ends d after the attempt starts (default AttemptTimeout).
func PerAttempt(d time.Duration) RetryOption { return func(c *retryConfig) { c.perAttempt = d } }

// MaxWait caps the wait between two attempts (RetryWait's ceiling; default 5 s).
func MaxWait(d time.Duration) RetryOption { return func(c *retryConfig) { c.maxWait = d } }

// LogRetries logs the 1st, 2nd, 4th, 8th... transient failure on log: "NATS not ready; retrying" with what.
func LogRetries(log *slog.Logger, what string) RetryOption {
	return func(c *retryConfig) { c.log, c.what = log, what }
}

// patient grows an attempt that timed out: the next is given twice as long, up to maxAttemptTimeout
// (retryPatient).
func patient() RetryOption { return func(c *retryConfig) { c.patient = true } }

// stopWhen gives up after a failed attempt when closed reports true (the bus's connection is closed).
func stopWhen(closed func() bool) RetryOption { return func(c *retryConfig) { c.closed = closed } }

// Retry runs op until it succeeds, fails for good, or ctx ends: a transient failure (IsTransient) is tried
// again on RetryWait's schedule (200-300 ms apart within the ElectionWindow, then growing to MaxWait), each
// attempt with a context of its own (PerAttempt), so a request whose answer was lost with a server is sent
// again instead of holding the caller until its deadline. A permission violation or a closed connection is
// not retried. When ctx ends during a wait, the error joins the last attempt's and ctx's. Only an op safe to
// repeat may be retried (a write with a Nats-Msg-Id, a key-value put).
func Retry(ctx context.Context, op func(attempt context.Context) error, opts ...RetryOption) error {
	cfg := retryConfig{perAttempt: AttemptTimeout, maxWait: maxRetryWait}
	for _, o := range opts {
		o(&cfg)
	}
	bo := &retryBackOff{maxElapsed: cfg.maxElapsed, ceiling: cfg.maxWait}
	attempt := 0
	patience := cfg.perAttempt
	var last error
	err := backoff.Retry(func() error {
		actx, cancel := context.WithTimeout(ctx, patience)
		err := op(actx)
		if cfg.patient && ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
			patience = min(2*patience, maxAttemptTimeout)
		}
		cancel()
		// A closed connection (Close was called) never comes back: not worth a retry.
		if err == nil || ctx.Err() != nil || errors.Is(err, ErrPermissionViolation) || !IsTransient(err) ||
			errors.Is(err, nats.ErrConnectionClosed) || cfg.closed != nil && cfg.closed() {
			if err != nil {
				return backoff.Permanent(err)
			}
			return nil
		}
		last = err
		attempt++
		// Attempts 200-300 ms apart during an election: the 1st, 2nd, 4th, 8th... failures say as much.
		if cfg.log != nil && attempt&(attempt-1) == 0 {
			cfg.log.Warn("NATS not ready; retrying", "what", cfg.what, "attempt", attempt, "err", err)
		}
		return err
	}, backoff.WithContext(bo, ctx))
	if last != nil && err != nil && err == ctx.Err() {
		return errors.Join(last, err)
	}
	return err
}

// retryTransientFor is retryTransient giving up after maxElapsed (0: only when ctx ends).
// op gets a context for the attempt (ctx bounded by AttemptTimeout); what must outlive the attempt (a
// watcher, a consumer's iterator) is made with ctx instead.
func (b *Bus) retryTransientFor(ctx context.Context, what string, maxElapsed time.Duration, op func(attempt context.Context) error) error {
	return b.retry(ctx, what, maxElapsed, false, op)
}

// maxAttemptTimeout bounds the attempts of retryPatient.
const maxAttemptTimeout = time.Minute

// retryPatient is retryTransientFor whose attempts grow patient: one that timed out is followed by one given
// twice as long (from AttemptTimeout up to maxAttemptTimeout). A request a server dropped is asked again after
// AttemptTimeout, but one a server is slow to answer (its JetStream API queue longer than an attempt) is not
// sent again and again at the same pace: the server does each abandoned attempt's work all the same, and
// 1,200 key-value watchers starting at once under -race, each sending its create request anew every 5 s,
// had 404 started and the rest stalled for a minute (TestBucketTakesAWatcherPerNodePastOneThousand).
func (b *Bus) retryPatient(ctx context.Context, what string, maxElapsed time.Duration, op func(attempt context.Context) error) error {
	return b.retry(ctx, what, maxElapsed, true, op)
}

// retry is Retry logged on b's logger, giving up once b's connection is closed.
func (b *Bus) retry(ctx context.Context, what string, maxElapsed time.Duration, patiently bool, op func(attempt context.Context) error) error {
	opts := []RetryOption{MaxElapsed(maxElapsed), LogRetries(b.log, what), stopWhen(b.nc.IsClosed)}
	if patiently {
		opts = append(opts, patient())
	}
	return Retry(ctx, op, opts...)
}
