package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestIsTransientDuplicateInProcess: the stream leader's "duplicate message id is in process" (an earlier
// attempt with the same Nats-Msg-Id not yet stored) is worth a retry; a wrong last sequence is not.
func TestIsTransientDuplicateInProcess(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"duplicate in process", fmt.Errorf("publish: %w", &jetstream.APIError{Code: 409, ErrorCode: 10158, Description: "duplicate message id is in process"}), true},
		{"wrong last sequence", fmt.Errorf("publish: %w", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence}), false},
		{"unavailable", &jetstream.APIError{Code: 503, ErrorCode: 10008}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := IsTransient(tc.err); got != tc.want {
				t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

// TestIsTransientLegacyErrors: a key-value watcher's consumer is made by nats.go's older JetStream API, with
// its own error types: a create request no server took (its ErrJetStreamNotEnabled) and a 503 are retried as
// the newer API's are, a refusal over the consumer limit is not (and IsMaxConsumers names it).
func TestIsTransientLegacyErrors(t *testing.T) {
	maxConsumers := &nats.APIError{Code: 400, ErrorCode: 10026, Description: "maximum consumers limit reached"}
	for _, tc := range []struct {
		name               string
		err                error
		transient, maxCons bool
	}{
		{"no responders to a create", fmt.Errorf("kv watch: %w", nats.ErrJetStreamNotEnabled), true, false},
		{"unavailable", fmt.Errorf("kv watch: %w", &nats.APIError{Code: 503, ErrorCode: 10008}), true, false},
		{"over the consumer limit", fmt.Errorf("kv watch: %w", maxConsumers), false, true},
		{"over the consumer limit, newer API", &jetstream.APIError{Code: 400, ErrorCode: 10026}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := IsTransient(tc.err); got != tc.transient {
				t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.transient)
			}
			if got := IsMaxConsumers(tc.err); got != tc.maxCons {
				t.Errorf("IsMaxConsumers(%v) = %v, want %v", tc.err, got, tc.maxCons)
			}
		})
	}
}

// TestRetryWait: 200-300 ms apart while a cluster may be electing leaders, then growing from 500 ms to the
// ceiling, spread.
func TestRetryWait(t *testing.T) {
	for _, tc := range []struct {
		name             string
		failingFor, prev time.Duration
		lo, hi           time.Duration
	}{
		{"first retry", 0, 0, 200 * time.Millisecond, 300 * time.Millisecond},
		{"late in the election window", ElectionWindow - time.Millisecond, 250 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond},
		{"past the window", ElectionWindow, 250 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond},
		{"growing", 15 * time.Second, time.Second, time.Second, 2 * time.Second},
		{"at the ceiling", time.Minute, 4 * time.Second, maxRetryWait / 2, maxRetryWait},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seen := map[time.Duration]bool{}
			for range 1000 {
				d := RetryWait(tc.failingFor, tc.prev, maxRetryWait)
				if d < tc.lo || d > tc.hi {
					t.Fatalf("RetryWait(%v, %v) = %v, want in [%v, %v]", tc.failingFor, tc.prev, d, tc.lo, tc.hi)
				}
				seen[d] = true
			}
			if len(seen) < 100 {
				t.Errorf("RetryWait(%v, %v): %d distinct waits in 1000, want them spread", tc.failingFor, tc.prev, len(seen))
			}
		})
	}
}

// TestRetryTransientUsesANewLeaderAtOnce: a call failing while its stream has no leader (no responders, each
// attempt half a second of nats.go's own retries, 250 ms apart) succeeds within half a second of the leader's
// election, wherever in the election window (4-9 s after the loss) it comes. Before, the waits grew to
// seconds (250 ms by 1.5 to 5 s): a call went on failing up to 3.6 s with a leader there.
func TestRetryTransientUsesANewLeaderAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &Bus{nc: &nats.Conn{}, log: slog.New(slog.DiscardHandler)}
		for elected := 4 * time.Second; elected <= 9*time.Second; elected += 250 * time.Millisecond {
			start := time.Now()
			err := b.retryTransientFor(t.Context(), "kv put", kvRetryFor, func(context.Context) error {
				for try := 0; ; try++ {
					if time.Since(start) >= elected {
						return nil
					}
					if try == 2 {
						return fmt.Errorf("kv put: %w", jetstream.ErrNoStreamResponse)
					}
					time.Sleep(250 * time.Millisecond)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if late := time.Since(start) - elected; late > 500*time.Millisecond {
				t.Errorf("leader elected %v after the loss: the call succeeded %v after it, want within 500ms", elected, late)
			}
		}
	})
}

// TestRetryPatientGrowsAfterTimeouts: attempts that time out (a server slow to answer, its API queue longer
// than an attempt) are followed by attempts twice as long, up to maxAttemptTimeout, so a slow server is not
// sent the same request anew every AttemptTimeout; one that fails fast (no responders) leaves the patience as
// it is; retryTransientFor stays at AttemptTimeout.
func TestRetryPatientGrowsAfterTimeouts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		patient bool
		fails   []error // what each attempt ends with; nil: it waits for its context (a timeout)
		want    []time.Duration
	}{
		{"patient", true, []error{nil, nil, nil, nil, nil, nil},
			[]time.Duration{AttemptTimeout, 2 * AttemptTimeout, 4 * AttemptTimeout, 8 * AttemptTimeout, maxAttemptTimeout, maxAttemptTimeout}},
		{"patient, a fast failure between", true, []error{nil, nats.ErrNoResponders, nil},
			[]time.Duration{AttemptTimeout, 2 * AttemptTimeout, 2 * AttemptTimeout}},
		{"not patient", false, []error{nil, nil, nil}, []time.Duration{AttemptTimeout, AttemptTimeout, AttemptTimeout}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				b := &Bus{nc: &nats.Conn{}, log: slog.New(slog.DiscardHandler)}
				var got []time.Duration
				err := b.retry(t.Context(), "kv watch", 0, tc.patient, func(actx context.Context) error {
					deadline, _ := actx.Deadline()
					got = append(got, time.Until(deadline))
					i := len(got) - 1
					if i == len(tc.fails) {
						return nil
					}
					if tc.fails[i] != nil {
						return tc.fails[i]
					}
					<-actx.Done()
					return actx.Err()
				})
				if err != nil {
					t.Fatal(err)
				}
				if got = got[:len(tc.want)]; !equalDurations(got, tc.want) {
					t.Fatalf("attempts given %v, want %v", got, tc.want)
				}
			})
		})
	}
}

// TestRetry: Retry tries again what fails transiently, with a context per attempt (PerAttempt), waits at
// most MaxWait apart, gives up after MaxElapsed or when ctx ends (saying both why), and returns at once
// what no retry mends.
func TestRetry(t *testing.T) {
	transient := fmt.Errorf("put: %w", nats.ErrNoResponders)
	permanent := errors.New("bad request")
	for _, tc := range []struct {
		name      string
		opts      []RetryOption
		failFirst int   // attempts that fail with fail before the rest succeed
		fail      error // what they fail with
		ctxAfter  time.Duration
		wantErr   []error // what the error wraps (nil: no error)
		// attempts made; first attempt's context's deadline; longest wait between attempts; time to return
		attempts          int
		deadline, maxWait time.Duration
		within            time.Duration
	}{
		{name: "succeeds after transient failures", failFirst: 3, fail: transient,
			attempts: 4, deadline: AttemptTimeout, maxWait: 300 * time.Millisecond, within: time.Second},
		{name: "not transient", failFirst: 3, fail: permanent, wantErr: []error{permanent},
			attempts: 1, deadline: AttemptTimeout, within: 0},
		{name: "permission violation", failFirst: 3, fail: fmt.Errorf("%w: %w", ErrPermissionViolation, nats.ErrTimeout),
			wantErr: []error{ErrPermissionViolation}, attempts: 1, deadline: AttemptTimeout},
		{name: "closed connection", failFirst: 3, fail: nats.ErrConnectionClosed, wantErr: []error{nats.ErrConnectionClosed},
			attempts: 1, deadline: AttemptTimeout},
		{name: "PerAttempt", opts: []RetryOption{PerAttempt(time.Second)}, failFirst: 1, fail: transient,
			attempts: 2, deadline: time.Second, maxWait: 300 * time.Millisecond, within: time.Second},
		{name: "MaxElapsed", opts: []RetryOption{MaxElapsed(3 * time.Second)}, failFirst: 1000, fail: transient,
			wantErr: []error{nats.ErrNoResponders}, deadline: AttemptTimeout, maxWait: 300 * time.Millisecond, within: 3 * time.Second},
		{name: "MaxWait past the election window", opts: []RetryOption{MaxElapsed(time.Minute), MaxWait(time.Second)},
			failFirst: 1000, fail: transient, wantErr: []error{nats.ErrNoResponders}, deadline: AttemptTimeout,
			maxWait: time.Second, within: time.Minute},
		{name: "ctx ends", failFirst: 1000, fail: transient, ctxAfter: 2 * time.Second,
			wantErr: []error{nats.ErrNoResponders, context.DeadlineExceeded}, deadline: 2 * time.Second,
			maxWait: 300 * time.Millisecond, within: 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := t.Context()
				if tc.ctxAfter > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, tc.ctxAfter)
					defer cancel()
				}
				start := time.Now()
				var starts []time.Time
				var deadline time.Duration
				err := Retry(ctx, func(actx context.Context) error {
					if len(starts) == 0 {
						d, _ := actx.Deadline()
						deadline = time.Until(d)
					}
					starts = append(starts, time.Now())
					if len(starts) <= tc.failFirst {
						return tc.fail
					}
					return nil
				}, tc.opts...)
				took := time.Since(start)
				if tc.wantErr == nil && err != nil {
					t.Fatalf("Retry = %v, want nil", err)
				}
				if tc.wantErr != nil && err == nil {
					t.Fatalf("Retry = nil, want %v", tc.wantErr)
				}
				for _, want := range tc.wantErr {
					if !errors.Is(err, want) {
						t.Errorf("Retry = %v, want it to wrap %v", err, want)
					}
				}
				if tc.attempts > 0 && len(starts) != tc.attempts {
					t.Errorf("%d attempts, want %d", len(starts), tc.attempts)
				}
				if deadline != tc.deadline {
					t.Errorf("first attempt given %v, want %v", deadline, tc.deadline)
				}
				var longest time.Duration
				for i := 1; i < len(starts); i++ {
					longest = max(longest, starts[i].Sub(starts[i-1]))
				}
				if longest > tc.maxWait {
					t.Errorf("attempts up to %v apart, want at most %v", longest, tc.maxWait)
				}
				if tc.maxWait >= time.Second && longest < tc.maxWait/2 {
					t.Errorf("attempts at most %v apart past the election window, want waits growing to %v", longest, tc.maxWait)
				}
				if took > tc.within {
					t.Errorf("Retry returned after %v, want within %v", took, tc.within)
				}
			})
		})
	}
}

// TestRetryLogs: LogRetries says so on the 1st, 2nd and 4th failure, with what is retried.
func TestRetryLogs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var buf strings.Builder
		n := 0
		err := Retry(t.Context(), func(context.Context) error {
			if n++; n <= 4 {
				return nats.ErrNoResponders
			}
			return nil
		}, LogRetries(slog.New(slog.NewTextHandler(&buf, nil)), "kv put"))
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Count(buf.String(), `msg="NATS not ready; retrying" what="kv put"`); got != 3 {
			t.Errorf("%d log lines of 4 failures, want 3 (1st, 2nd, 4th):\n%s", got, buf.String())
		}
	})
}
