package puller

import (
	"testing"
	"time"
)

// TestBackoffArithmetic: the kubelet's image backoff with its production numbers: windows 10, 20, 40, 80,
// 160, 300, 300 s; "in backoff" strictly inside the window; an entry idle for more than 600 s expires and
// the next failure starts again at 10 s.
func TestBackoffArithmetic(t *testing.T) {
	p := backoffPolicy{initial: 10 * time.Second, max: 300 * time.Second}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var e backoffEntry
	ok := false
	now := t0
	for i, want := range []time.Duration{10, 20, 40, 80, 160, 300, 300, 300} {
		e = p.next(e, ok, now)
		ok = true
		if e.Backoff != want*time.Second {
			t.Fatalf("failure %d: window %v, want %v", i+1, e.Backoff, want*time.Second)
		}
		if !p.inBackoff(e, ok, now.Add(e.Backoff-time.Millisecond)) {
			t.Errorf("failure %d: not in backoff just before the window ends", i+1)
		}
		if p.inBackoff(e, ok, now.Add(e.Backoff)) {
			t.Errorf("failure %d: in backoff at exactly the window's end (must be strict)", i+1)
		}
		now = now.Add(e.Backoff)
	}
	for _, c := range []struct {
		name    string
		idle    time.Duration
		expired bool
	}{
		{"idle 600s is not expired", 600 * time.Second, false},
		{"idle 600s+1ns is expired", 600*time.Second + 1, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			at := e.LastUpdate.Add(c.idle)
			if got := p.expired(e, at); got != c.expired {
				t.Fatalf("expired = %v, want %v", got, c.expired)
			}
			n := p.next(e, true, at)
			want := 300 * time.Second
			if c.expired {
				want = 10 * time.Second
			}
			if n.Backoff != want {
				t.Errorf("next window %v, want %v", n.Backoff, want)
			}
		})
	}
	// GC drops only expired entries; a success does not reset a live entry.
	s := newMemBackoff()
	_ = s.Put(t.Context(), backoffEntry{Key: "live", Backoff: 10 * time.Second, LastUpdate: t0})
	_ = s.Put(t.Context(), backoffEntry{Key: "old", Backoff: 10 * time.Second, LastUpdate: t0.Add(-601 * time.Second)})
	s.GC(t.Context(), t0, p)
	if _, ok, _ := s.Get(t.Context(), "live"); !ok {
		t.Error("GC dropped a live entry")
	}
	if _, ok, _ := s.Get(t.Context(), "old"); ok {
		t.Error("GC kept an expired entry")
	}
}
