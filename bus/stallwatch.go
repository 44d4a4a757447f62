package bus

import (
	"math/rand/v2"
	"time"
)

// maxStallCheckPeriod bounds the period at which the watchdog asks an idle consumer's info (below).
const maxStallCheckPeriod = 5 * time.Minute

// stallVerdict is what one look at a consumer's info says, and what the watchdog does about it.
type stallVerdict int

const (
	stallOK        stallVerdict = iota // nothing wrong
	stallSuspect                       // no pull request of ours at the server once: look again soon
	stallNoWaiting                     // no pull request of ours twice in a row, with room: pull anew
	stallStuck                         // messages wait, a pull request waits, none delivered: pull anew
	stallNoAnswer                      // the info request failed twice in a row: make the consumer anew
)

// judgeStall reads one consumer info: room says this process has a free handler.
func judgeStall(pending uint64, ackPending, maxAckPending, waiting int, room bool) stallVerdict {
	switch {
	case waiting == 0 && room:
		return stallSuspect
	case pending == 0 || ackPending >= maxAckPending:
		return stallOK
	default:
		return stallStuck
	}
}

// stallWatch schedules the watchdog's looks at an idle consumer. An idle consumer (a puller with nothing to
// pull, the removals or kube-events consumers between events) stays idle for hours, and each look is a
// JetStream API request that the consumer's stream leader answers: at a fixed 5 s, 10,000 agents asked
// 2,000 a second, which saturated the 3-server cluster of docs/scale.md. So the first look comes StallAfter
// after the last delivery and each one after it waits twice as long (15 s, 30 s, 1 m, ... up to
// maxStallCheckPeriod), jittered by ±20% so a fleet started at once does not ask at once. A delivery starts
// the schedule over. A reason to look is a look soon: a missed heartbeat (hint), or a first look that found
// no pull request of ours at the server (confirmed StallAfter/3 later, as before). A look that fails
// (timeout: the API is saturated, or the consumer has no leader) backs off like a quiet one; only a second
// failure in a row makes the consumer anew, and the schedule does not start over after a restart the
// watchdog made, only after a delivery, so a saturated cluster is not answered with a storm of re-creations.
type stallWatch struct {
	stallAfter   time.Duration
	period       time.Duration // wait after the next look that finds nothing wrong
	next         time.Time     // when the next look is due
	lastDelivery time.Time     // the delivery the schedule started from
	lastActive   time.Time     // the last delivery or (re)start of the pull
	failures     int           // looks in a row whose info request failed
	suspect      bool          // the last look found no pull request of ours
	// The early look after a replicated consumer's (re)start (started): due at the next look's turn,
	// budgeted one per delivery.
	soon, early bool // soon: an early look is due; early: the look being made is one
	earlyBudget int
	jitter      func() float64
}

// earlyLookAfter is how long after a replicated consumer's (re)start its early look may come: long enough
// for the first pull request to reach the consumer's leader (a few milliseconds on a healthy cluster).
const earlyLookAfter = 2 * time.Second

// started records that the pull of a replicated consumer (R>1) was (re)started at least earlyLookAfter
// ago, and makes an early look due if the budget allows. A pull request that reaches the servers while the
// consumer's Raft group has no leader (just created, or electing one) is dropped without a word: nats.go
// learns of it only when two heartbeats are missed (30 s), the schedule above at StallAfter + StallAfter/3
// (20 s), and a pull request queued meanwhile waits that long. 300 hollow agents on a 3-server cluster,
// pre-pulling 20 s after they started, had nodes wait 1.5-7 s for it (docs/benchmarks.md). The early look
// finds that at once. One per delivery: a cluster that stays without leaders gets one extra info request
// and pull per consumer, not one every few seconds.
func (w *stallWatch) started() {
	if w.earlyBudget > 0 {
		w.earlyBudget--
		w.soon = true
	}
}

func newStallWatch(stallAfter time.Duration, now time.Time) *stallWatch {
	w := &stallWatch{stallAfter: stallAfter, jitter: func() float64 { return 0.8 + 0.4*rand.Float64() }}
	w.restart(now, now)
	return w
}

func (w *stallWatch) restart(delivery, active time.Time) {
	w.lastDelivery, w.lastActive = delivery, active
	w.earlyBudget = 1
	w.period, w.failures, w.suspect = w.stallAfter, 0, false
	w.next = active.Add(w.stallAfter)
}

// due reports whether a look is due at now, given the last delivery and the last delivery or (re)start of
// the pull, and whether a hint came.
func (w *stallWatch) due(now, lastDelivery, lastActive time.Time, hinted bool) bool {
	switch {
	case lastDelivery.After(w.lastDelivery):
		w.restart(lastDelivery, lastActive)
	case lastActive.After(w.lastActive):
		// Pulling anew (a restart the watchdog or the loop made) is no sign of health: keep the period.
		w.lastActive = lastActive
		w.failures, w.suspect = 0, false
		w.next = lastActive.Add(max(w.stallAfter, w.period))
	}
	if hinted {
		w.period = w.stallAfter
		w.next = now
	}
	if !now.Before(w.next) && now.Sub(w.lastActive) >= w.stallAfter {
		w.soon = false // the scheduled look is made instead
		return true
	}
	if w.soon {
		w.soon, w.early = false, true
		return true
	}
	return false
}

// checked records a look made at now (err: the info request's error; v: judgeStall's verdict, if err is
// nil) and returns what to do.
func (w *stallWatch) checked(now time.Time, err error, v stallVerdict) stallVerdict {
	if w.early {
		// Just started: no pull request of ours is no expiry gap (the first lasts 30 s), so pull anew at
		// once; anything else leaves the schedule as it was.
		w.early = false
		if err == nil && v == stallSuspect {
			return stallNoWaiting
		}
		return stallOK
	}
	backOff := func() {
		w.next = now.Add(time.Duration(float64(w.period) * w.jitter()))
		w.period = min(2*w.period, max(maxStallCheckPeriod, w.stallAfter))
	}
	if err != nil {
		w.suspect = false
		if w.failures++; w.failures >= 2 {
			w.failures = 0
			backOff()
			return stallNoAnswer
		}
		backOff()
		return stallOK
	}
	w.failures = 0
	switch {
	case v == stallSuspect && w.suspect:
		w.suspect = false
		backOff()
		return stallNoWaiting
	case v == stallSuspect:
		// A pull request may be between its expiry and the next: look again soon.
		w.suspect = true
		w.next = now.Add(max(w.stallAfter/3, 10*time.Millisecond))
		return stallSuspect
	case v == stallStuck:
		w.suspect = false
		backOff()
		return stallStuck
	}
	w.suspect = false
	backOff()
	return stallOK
}
