package detector

import (
	"context"
	"fmt"
	"testing"
	"testing/synctest"
	"time"
)

// TestRetryWait: the retry of unpublished events waits 1 s doubling to 30 s, each wait drawn from the upper
// half, so nodes refused together spread their retries.
func TestRetryWait(t *testing.T) {
	for _, tc := range []struct {
		failed int
		lo, hi time.Duration
	}{
		{0, 500 * time.Millisecond, time.Second},
		{1, time.Second, 2 * time.Second},
		{2, 2 * time.Second, 4 * time.Second},
		{3, 4 * time.Second, 8 * time.Second},
		{4, 8 * time.Second, 16 * time.Second},
		{5, 15 * time.Second, 30 * time.Second},
		{60, 15 * time.Second, 30 * time.Second},
	} {
		seen := map[time.Duration]bool{}
		for range 1000 {
			d := retryWait(tc.failed)
			if d < tc.lo || d >= tc.hi {
				t.Fatalf("retryWait(%d) = %v, want in [%v, %v)", tc.failed, d, tc.lo, tc.hi)
			}
			seen[d] = true
		}
		if len(seen) < 100 {
			t.Errorf("retryWait(%d): %d distinct waits in 1000, want them spread", tc.failed, len(seen))
		}
	}
}

// TestRecordsWriteUsesANewLeaderAtOnce: a records write failing while the bucket has no leader (each attempt
// ending after half a second, as nats.go's own no-responders retries do) goes through within half a second
// of the leader's election, wherever in the election window (4-9 s after the loss) it comes, and with it the
// detect command waiting for it. Before, the waits doubled to 2 s: a detector answered 1.7 s after its
// bucket's election, 10.4 s after the loss.
func TestRecordsWriteUsesANewLeaderAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for elected := 4 * time.Second; elected <= 9*time.Second; elected += 250 * time.Millisecond {
			start := time.Now()
			err := call(t.Context(), 1, func(context.Context) error {
				for try := 0; ; try++ {
					if time.Since(start) >= elected {
						return nil
					}
					if try == 2 {
						// Any transient failure: bus.IsTransient decides, the attempt's length matters.
						return fmt.Errorf("write records: %w", context.DeadlineExceeded)
					}
					time.Sleep(250 * time.Millisecond)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if late := time.Since(start) - elected; late > 500*time.Millisecond {
				t.Errorf("leader elected %v after the loss: the write went through %v after it, want within 500ms", elected, late)
			}
		}
	})
}
