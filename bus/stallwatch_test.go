package bus

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestStallWatchBacksOff: an idle consumer is looked at 15 s after its last delivery, then at periods that
// double up to maxStallCheckPeriod; a delivery starts over; a hint makes a look due at once, but hints in a
// row no more often than every StallAfter/3; a failed look backs off and only a second one in a row makes the
// consumer anew, which keeps the period.
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
	t.Run("hint", func(t *testing.T) {
		w := newWatch()
		looks(w, 0, 10*time.Minute, t0, nil, stallOK) // looked at 8 m, next look at 13 m
		now := t0.Add(10*time.Minute + 10*time.Second)
		if !w.due(now, t0, w.lastActive, true) {
			t.Fatal("a hint did not make a look due at once")
		}
		if v := w.checked(now, nil, stallOK); v != stallOK {
			t.Fatalf("verdict %v", v)
		}
		// A hint a second (every pull request sent anew lost too): a look at most every StallAfter/3.
		var at []time.Duration
		for d := 10*time.Minute + 11*time.Second; d <= 10*time.Minute+30*time.Second; d += time.Second {
			now := t0.Add(d)
			if w.due(now, t0, w.lastActive, true) {
				at = append(at, d)
				w.checked(now, nil, stallOK)
			}
		}
		want := []time.Duration{10*time.Minute + 15*time.Second, 10*time.Minute + 20*time.Second,
			10*time.Minute + 25*time.Second, 10*time.Minute + 30*time.Second}
		if !equalDurations(at, want) {
			t.Fatalf("looks under a hint a second at %v, want %v", at, want)
		}
		// A delivery drops a hinted look not yet made: the pull works.
		w.due(t0.Add(10*time.Minute+31*time.Second), t0, w.lastActive, true)
		delivered := t0.Add(10*time.Minute + 32*time.Second)
		if w.due(delivered, delivered, delivered, false) {
			t.Fatal("a look due right after a delivery")
		}
	})
	t.Run("hinted looks find the consumer gone", func(t *testing.T) {
		w := newWatch()
		// The loop pulls anew after each loss (which is not a restart of the consumer), hinting each time.
		gone := errors.New("consumer not found")
		var verdicts []stallVerdict
		var at []time.Duration
		for d := time.Second; d <= 20*time.Second; d += time.Second {
			now := t0.Add(d)
			if w.due(now, t0, t0, true) {
				at, verdicts = append(at, d), append(verdicts, w.checked(now, gone, 0))
			}
		}
		if len(verdicts) < 2 || verdicts[0] != stallOK || verdicts[1] != stallNoAnswer || at[1] != 6*time.Second {
			t.Fatalf("hinted looks at a consumer that is gone at %v: %v, want stallOK then, 5 s later, stallNoAnswer (make it anew)", at, verdicts)
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

// TestJudgeStall: what one look at a consumer's info says.
func TestJudgeStall(t *testing.T) {
	for _, tc := range []struct {
		name                            string
		pending                         uint64
		ackPending, maxAckPending, wait int
		room                            bool
		want                            stallVerdict
	}{
		{"idle, a request waiting", 0, 0, 256, 1, true, stallOK},
		{"no request of ours, a handler free", 0, 0, 256, 0, true, stallSuspect},
		{"messages wait, a request waits, none delivered", 5, 0, 256, 1, true, stallStuck},
		{"messages wait behind the ack limit", 5, 256, 256, 1, true, stallOK},
		// One handler, busy longer than StallAfter: it asks for nothing meanwhile.
		{"messages wait, every handler busy, no request", 5, 1, 256, 0, false, stallOK},
		{"messages wait, every handler busy, a request waits", 5, 4, 16, 1, false, stallStuck},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := judgeStall(tc.pending, tc.ackPending, tc.maxAckPending, tc.wait, tc.room); got != tc.want {
				t.Fatalf("judgeStall = %v, want %v", got, tc.want)
			}
		})
	}
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

// TestDeliveryReadsItsAckSubject: a delivered message's consumer, count, stream and consumer sequences, time
// and pending count are read from its reply subject in both of nats-server's forms (v2, with the domain and
// account hash, behind a feature flag), and a reply that is no ack subject is refused rather than read wrong.
func TestDeliveryReadsItsAckSubject(t *testing.T) {
	type read struct {
		consumer                                 string
		delivered, seq, consumerSeq, ts, pending uint64
	}
	for _, tc := range []struct {
		name, reply string
		want        read
		wantErr     bool
	}{
		{"v1", "$JS.ACK.EVENTS.removals-n1.3.1207.40.1764250000000000000.5", read{"removals-n1", 3, 1207, 40, 1764250000000000000, 5}, false},
		{"v2", "$JS.ACK._.ACCHASH.EVENTS.removals-n1.2.88.9.1764250000000000000.0", read{"removals-n1", 2, 88, 9, 1764250000000000000, 0}, false},
		{"v2 with a token more", "$JS.ACK.hub.ACCHASH.EVENTS.tail_X.1.7.7.1764250000000000000.0.x1y2", read{"tail_X", 1, 7, 7, 1764250000000000000, 0}, false},
		{"not an ack subject", "_INBOX.abc.def", read{}, true},
		{"ten tokens", "$JS.ACK.a.b.EVENTS.c.1.2.3.4", read{}, true},
		{"not a number", "$JS.ACK.EVENTS.c.x.2.3.4.5", read{}, true},
		{"pending not a number", "$JS.ACK.EVENTS.c.1.2.3.4.x", read{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := newDelivery(nil, &nats.Msg{Reply: tc.reply})
			if tc.wantErr {
				if err == nil {
					t.Fatalf("%q read as delivered %d, seq %d; want an error", tc.reply, d.numDelivered, d.streamSeq)
				}
				return
			}
			if err != nil {
				t.Fatalf("%q: %v", tc.reply, err)
			}
			got := read{d.consumer, d.numDelivered, d.streamSeq, d.consumerSeq, uint64(d.time.UnixNano()), d.pending}
			if got != tc.want {
				t.Fatalf("%q read as %+v, want %+v", tc.reply, got, tc.want)
			}
		})
	}
}
