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
	stallStuck                         // messages wait, a pull request of ours waits, none delivered: pull anew
	stallNoAnswer                      // the info request failed twice in a row: make the consumer anew
)

// judgeStall reads one consumer info: room says this process has a free handler. Messages waiting while no
// pull request of ours does are no stall when every handler is busy: a consumer with one handler asks for
// nothing while it runs (the removals handler waits up to its 30 s grace), and was made anew for it.
func judgeStall(pending uint64, ackPending, maxAckPending, waiting int, room bool) stallVerdict {
	switch {
	case waiting == 0 && room:
		return stallSuspect
	case waiting == 0 || pending == 0 || ackPending >= maxAckPending:
		return stallOK
	default:
		return stallStuck
	}
}

// stallWatch schedules the watchdog's looks at an idle consumer. A lost pull request is not the watchdog's to
// find: its heartbeats stop, and the pull loop sends it again after two missed heartbeats (2 s by default), at no API cost. What
// is left to the watchdog needs the consumer's info: a consumer that is gone or has no leader (its info
// fails, and only making it anew mends that), a server that holds no pull request of ours although no
// heartbeat went missing, messages that wait while a request of ours waits too. An idle consumer (a puller
// with nothing to pull, the removals or kube-events consumers between events) stays idle for hours, and each
// look is a JetStream API request that the consumer's stream leader answers: at a fixed 5 s, 10,000 agents
// asked 2,000 a second, which saturated the 3-server cluster of docs/scale.md. So the first look comes
// StallAfter after the last delivery and each one after it waits twice as long (15 s, 30 s, 1 m, ... up to
// maxStallCheckPeriod), jittered by ±20% so a fleet started at once does not ask at once. A delivery starts
// the schedule over. A reason to look is a look soon: a hint (the pull loop lost a pull request, then the
// one it sent again), or a first look that found no pull request of ours at the server (confirmed
// StallAfter/3 later). A hinted look comes at once, but never sooner than StallAfter/3 after the last look,
// however many hints come: a cluster that loses every pull request is not asked for each consumer's info
// every second. A look that fails (timeout: the API is saturated, or the consumer has no leader) backs off
// like a quiet one; only a second failure in a row makes the consumer anew, and the schedule does not start
// over after the consumer was made anew, only after a delivery, so a saturated cluster is not answered with
// a storm of re-creations.
type stallWatch struct {
	stallAfter   time.Duration
	period       time.Duration // wait after the next look that finds nothing wrong
	next         time.Time     // when the next scheduled look is due
	lastDelivery time.Time     // the delivery the schedule started from
	lastActive   time.Time     // the last delivery or (re)opening of the consumer
	lastLook     time.Time     // when the last look was made
	hintAt       time.Time     // when a hinted look is due (zero: none is)
	failures     int           // looks in a row whose info request failed
	suspect      bool          // the last look found no pull request of ours
	jitter       func() float64
}

func newStallWatch(stallAfter time.Duration, now time.Time) *stallWatch {
	w := &stallWatch{stallAfter: stallAfter, jitter: func() float64 { return 0.8 + 0.4*rand.Float64() }}
	w.restart(now, now)
	return w
}

func (w *stallWatch) restart(delivery, active time.Time) {
	w.lastDelivery, w.lastActive = delivery, active
	w.period, w.failures, w.suspect = w.stallAfter, 0, false
	w.hintAt = time.Time{}
	w.next = active.Add(w.stallAfter)
}

// recheck is how soon a look may follow the last one: a suspicion's confirmation, a hinted look.
func (w *stallWatch) recheck() time.Duration { return max(w.stallAfter/3, 10*time.Millisecond) }

// due reports whether a look is due at now, given the last delivery and the last delivery or (re)opening of
// the consumer, and whether a hint came.
func (w *stallWatch) due(now, lastDelivery, lastActive time.Time, hinted bool) bool {
	switch {
	case lastDelivery.After(w.lastDelivery):
		w.restart(lastDelivery, lastActive)
	case lastActive.After(w.lastActive):
		// The consumer made anew (by the watchdog, or after it was deleted) is no sign of health: keep the
		// period.
		w.lastActive = lastActive
		w.failures, w.suspect = 0, false
		w.next = lastActive.Add(max(w.stallAfter, w.period))
	}
	if hinted && w.hintAt.IsZero() {
		w.hintAt = now
		if soonest := w.lastLook.Add(w.recheck()); !w.lastLook.IsZero() && soonest.After(now) {
			w.hintAt = soonest
		}
	}
	if !w.hintAt.IsZero() && !now.Before(w.hintAt) {
		return true
	}
	return !now.Before(w.next) && now.Sub(w.lastActive) >= w.stallAfter
}

// checked records a look made at now (err: the info request's error; v: judgeStall's verdict, if err is
// nil) and returns what to do.
func (w *stallWatch) checked(now time.Time, err error, v stallVerdict) stallVerdict {
	w.lastLook, w.hintAt = now, time.Time{}
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
		w.next = now.Add(w.recheck())
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
