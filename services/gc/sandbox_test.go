package gc

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestSandboxImageReadOncePerTTL: passes within sandboxImageTTL of a read reuse it; a later pass reads the
// runtime again; a failed read is not kept.
func TestSandboxImageReadOncePerTTL(t *testing.T) {
	now := time.Date(2026, 11, 28, 22, 0, 0, 0, time.UTC)
	reads := 0
	answer, fail := "registry.k8s.io/pause:3.10", false
	c := &sandboxCache{now: func() time.Time { return now }, read: func(context.Context) (string, error) {
		reads++
		if fail {
			return "", errors.New("runtime status: unavailable")
		}
		return answer, nil
	}}
	get := func(want string, wantReads int) {
		t.Helper()
		got, err := c.get(t.Context())
		if err != nil || got != want || reads != wantReads {
			t.Fatalf("at %s: %q, %v after %d reads; want %q after %d", now.Format(time.TimeOnly), got, err, reads, want, wantReads)
		}
	}
	get("registry.k8s.io/pause:3.10", 1)
	answer = "registry.k8s.io/pause:3.11" // the runtime reconfigured
	now = now.Add(sandboxImageTTL - time.Second)
	get("registry.k8s.io/pause:3.10", 1)
	now = now.Add(time.Second)
	get("registry.k8s.io/pause:3.11", 2)

	now = now.Add(sandboxImageTTL)
	fail = true
	if _, err := c.get(t.Context()); err == nil || reads != 3 {
		t.Fatalf("a failed read: %v after %d reads, want the error after 3", err, reads)
	}
	fail = false
	get("registry.k8s.io/pause:3.11", 4) // read again, not the failure kept
}
