package detector

import (
	"testing"
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
