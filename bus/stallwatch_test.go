package bus

import (
	"errors"
	"testing"
	"time"
)

// TestStallWatchBacksOff: an idle consumer is looked at 15 s after its last delivery, then at periods that
// double up to maxStallCheckPeriod; a delivery starts over; a hint makes a look due at once; a failed look
// backs off and only a second one in a row makes the consumer anew, whose restart keeps the period.
func TestStallWatchBacksOff(t *testing.T) {
	const stallAfter = 15 * time.Second
	t0 := time.Unix(1_000_000, 0)
	newWatch := func() *stallWatch {
		w := newStallWatch(stallAfter, t0)
		w.jitter = func() float64 { return 1 }
		return w
	}
	// looks returns the times (since t0) of the looks made until end, each finding v, with no delivery.
	looks := func(w *stallWatch, from, end time.Duration, lastDelivery time.Time, err error, v stallVerdict) []time.Duration {
		var at []time.Duration
		for d := from; d <= end; d += time.Second {
			now := t0.Add(d)
			if w.due(now, lastDelivery, w.lastActive, false) {
				at = append(at, d)
				w.checked(now, err, v)
			}
		}
		return at
	}
	t.Run("idle", func(t *testing.T) {
		w := newWatch()
		got := looks(w, 0, 20*time.Minute, t0, nil, stallOK)
		want := []time.Duration{15 * time.Second, 30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute,
			8 * time.Minute, 13 * time.Minute, 18 * time.Minute}
		if !equalDurations(got, want) {
			t.Fatalf("looks at %v, want %v", got, want)
		}
	})
	t.Run("delivery starts over", func(t *testing.T) {
		w := newWatch()
		looks(w, 0, 10*time.Minute, t0, nil, stallOK)
		delivered := t0.Add(10*time.Minute + 30*time.Second)
		w.due(delivered, delivered, delivered, false)
		if got := looks(w, 10*time.Minute+31*time.Second, 11*time.Minute+30*time.Second, delivered, nil, stallOK); !equalDurations(got, []time.Duration{10*time.Minute + 45*time.Second, 11 * time.Minute, 11*time.Minute + 30*time.Second}) {
			t.Fatalf("after a delivery, looks at %v", got)
		}
	})
	t.Run("early look after a replicated start", func(t *testing.T) {
		w := newWatch()
		w.started()
		now := t0.Add(5 * time.Second)
		if !w.due(now, t0, t0, false) {
			t.Fatal("no early look 5 s after the start")
		}
		if v := w.checked(now, nil, stallSuspect); v != stallNoWaiting {
			t.Fatalf("early look finding no pull request: %v, want stallNoWaiting (pull anew at once)", v)
		}
		// Pulled anew: a second early look needs a delivery first.
		restarted := now
		w.started()
		if w.due(t0.Add(10*time.Second), t0, restarted, false) {
			t.Fatal("a second early look without a delivery between")
		}
		delivered := t0.Add(12 * time.Second)
		w.due(delivered, delivered, delivered, false)
		w.started()
		now = t0.Add(14 * time.Second)
		if !w.due(now, delivered, delivered, false) {
			t.Fatal("no early look after a delivery and a restart")
		}
		next := w.next
		if v := w.checked(now, nil, stallOK); v != stallOK || !w.next.Equal(next) {
			t.Fatalf("an early look finding a pull request: %v, next look moved from %v to %v", v, next, w.next)
		}
		if got := looks(w, 15*time.Second, time.Minute, delivered, nil, stallOK); !equalDurations(got, []time.Duration{27 * time.Second, 42 * time.Second}) {
			t.Fatalf("schedule after the early look: looks at %v", got)
		}
	})
	t.Run("no early look without a start", func(t *testing.T) {
		w := newWatch()
		if got := looks(w, 0, 20*time.Second, t0, nil, stallSuspect); !equalDurations(got, []time.Duration{15 * time.Second, 20 * time.Second}) {
			t.Fatalf("looks at %v", got)
		}
	})
	t.Run("hint", func(t *testing.T) {
		w := newWatch()
		looks(w, 0, 10*time.Minute, t0, nil, stallOK) // next look at 13 m
		now := t0.Add(10*time.Minute + 10*time.Second)
		if !w.due(now, t0, w.lastActive, true) {
			t.Fatal("a hint did not make a look due")
		}
		if v := w.checked(now, nil, stallOK); v != stallOK {
			t.Fatalf("verdict %v", v)
		}
		if !w.next.Equal(now.Add(stallAfter)) {
			t.Fatalf("after a hint, next look at %v, want %v", w.next.Sub(t0), now.Add(stallAfter).Sub(t0))
		}
	})
	t.Run("no pull request twice in a row", func(t *testing.T) {
		w := newWatch()
		now := t0.Add(stallAfter)
		if !w.due(now, t0, t0, false) || w.checked(now, nil, stallSuspect) != stallSuspect {
			t.Fatal("first look without a pull request is not a suspicion")
		}
		now = now.Add(stallAfter / 3)
		if !w.due(now, t0, t0, false) || w.checked(now, nil, stallSuspect) != stallNoWaiting {
			t.Fatal("second look without a pull request, StallAfter/3 later, does not pull anew")
		}
	})
	t.Run("failures back off", func(t *testing.T) {
		w := newWatch()
		timeout := errors.New("context deadline exceeded")
		var verdicts []stallVerdict
		var at []time.Duration
		for d := time.Duration(0); d <= 10*time.Minute; d += time.Second {
			now := t0.Add(d)
			if w.due(now, t0, w.lastActive, false) {
				v := w.checked(now, timeout, 0)
				at, verdicts = append(at, d), append(verdicts, v)
				if v == stallNoAnswer {
					w.due(now, t0, now, false) // the watchdog restarts the pull
				}
			}
		}
		wantAt := []time.Duration{15 * time.Second, 30 * time.Second, 90 * time.Second, 150 * time.Second, 390 * time.Second}
		wantV := []stallVerdict{stallOK, stallNoAnswer, stallOK, stallNoAnswer, stallOK}
		if !equalDurations(at, wantAt) || len(verdicts) != len(wantV) {
			t.Fatalf("failed looks at %v (%v), want %v (%v)", at, verdicts, wantAt, wantV)
		}
		for i := range wantV {
			if verdicts[i] != wantV[i] {
				t.Fatalf("verdicts %v, want %v", verdicts, wantV)
			}
		}
	})
}

func equalDurations(a, b []time.Duration) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
