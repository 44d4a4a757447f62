package fleet

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestRetryTransientBoundsEachAttempt: an attempt that never returns on its own (a publish whose ack was lost
// with a killed server) ends after attemptTimeout and is tried again, within a caller's long deadline; the
// second attempt's success is the result.
func TestRetryTransientBoundsEachAttempt(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	began := time.Now()
	attempts := 0
	err := retryTransient(ctx, func(actx context.Context) error {
		attempts++
		dl, ok := actx.Deadline()
		if !ok || time.Until(dl) > attemptTimeout {
			t.Errorf("attempt %d: deadline %v (set %v), want at most %v away", attempts, time.Until(dl), ok, attemptTimeout)
		}
		if attempts == 1 {
			<-actx.Done() // the lost ack
			return actx.Err()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("retryTransient: %v", err)
	}
	if attempts != 2 {
		t.Errorf("%d attempts, want 2", attempts)
	}
	if took := time.Since(began); took < attemptTimeout || took > attemptTimeout+5*time.Second {
		t.Errorf("took %v, want about %v (one attempt timing out, then one succeeding)", took, attemptTimeout)
	}
}

// TestRetryTransientStopsOnAPermanentError: an error that is not transient is returned at once.
func TestRetryTransientStopsOnAPermanentError(t *testing.T) {
	attempts := 0
	want := errors.New("permissions violation")
	err := retryTransient(t.Context(), func(context.Context) error { attempts++; return want })
	if !errors.Is(err, want) || attempts != 1 {
		t.Fatalf("err %v after %d attempts, want %v after 1", err, attempts, want)
	}
}
