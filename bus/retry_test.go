package bus

import (
	"context"
	"fmt"
	"log/slog"
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
