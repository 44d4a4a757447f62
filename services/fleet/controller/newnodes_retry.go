package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// A failed join's retries: each attempt is a one-node rollout of its own, so the engine's promise (no node
// acted on twice within a rollout id) holds per attempt; a controller that restarts finds the latest attempt
// on the bus and goes on from it.

// Join retries wait firstJoinRetry after a failure, doubling, at most maxJoinRetry apart, without end.
const (
	firstJoinRetry = 30 * time.Second
	maxJoinRetry   = 10 * time.Minute
)

// joinBackoff is the wait after attempt attempt (1 the first) failed.
func joinBackoff(attempt int) time.Duration {
	d := firstJoinRetry
	for i := 1; i < attempt && d < maxJoinRetry; i++ {
		d *= 2
	}
	return min(d, maxJoinRetry)
}

// JoinAttemptID names attempt attempt (1 the first) of the join JoinRolloutID(rolloutID, node, uid) names:
// the first attempt has that id; attempt k>=2 has <rolloutID>-join-<16 hex digits of a SHA-256> over the same
// input and k. Every attempt's id is as long as the first's (a rollout id holds at most 64 characters), and
// none ends in "-<digits>" as the pull requests of an ImagePrePull's later images do (<id>-<i>).
func JoinAttemptID(rolloutID, node string, uid types.UID, attempt int) string {
	if attempt <= 1 {
		return JoinRolloutID(rolloutID, node, uid)
	}
	in := node
	if uid != "" {
		in = node + "\x00" + string(uid)
	}
	sum := sha256.Sum256([]byte(in + "\x00attempt " + strconv.Itoa(attempt)))
	return rolloutID + "-join-" + hex.EncodeToString(sum[:8])
}

// joinRollouts reads and runs the join rollouts: the bus's (busJoins); a test's fake stands in.
type joinRollouts interface {
	// started reads only rollout id's start record (nil: it never started), in one lookup.
	started(ctx context.Context, id string) (*events.RolloutStarted, error)
	// load reads everything recorded about rollout id.
	load(ctx context.Context, id string) (*events.RolloutStarted, map[string]events.RolloutClaim, map[string]events.RolloutNodeResult, error)
	// run runs (resumes) the one-node rollout id that warms node for ko and returns node's outcome.
	run(ko *keptObject, id, node, domain string) (events.RolloutNodeResult, error)
	// alive reports whether node heartbeats: its key in events.NodesBucket (which expires when the node
	// stops) is there. An error leaves it unknown.
	alive(ctx context.Context, node string) (bool, error)
}

// busJoins are the join rollouts on the bus, run through the rollout engine.
type busJoins struct{ k *keeper }

func (b busJoins) started(ctx context.Context, id string) (*events.RolloutStarted, error) {
	return fleet.LoadRolloutStarted(ctx, b.k.b, id)
}

func (b busJoins) load(ctx context.Context, id string) (*events.RolloutStarted, map[string]events.RolloutClaim, map[string]events.RolloutNodeResult, error) {
	return fleet.LoadRollout(ctx, b.k.b, id)
}

func (b busJoins) alive(ctx context.Context, node string) (bool, error) {
	e, err := b.k.b.GetKey(ctx, events.NodesBucket, events.NodeToken(node))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return !e.Deleted, nil
}

func (b busJoins) run(ko *keptObject, id, node, domain string) (nr events.RolloutNodeResult, err error) {
	k, ctx := b.k, ko.ctx
	var timeout time.Duration
	if ko.obj.Spec.NodeTimeout != nil {
		timeout = ko.obj.Spec.NodeTimeout.Duration
	}
	cfg := fleet.RolloutConfig{ID: id, Kind: k.kind.rollout, Nodes: []string{node}, Selector: selectorString(ko), NodeTimeout: timeout,
		Replicas: k.cfg.StreamReplicas, Logger: k.log}
	domains := map[string]string{}
	if domain != "" {
		domains[node] = domain
	}
	act, stop, err := k.kind.prepare(ctx, k.b, ko.obj, &cfg, domains)
	if err != nil {
		return nr, err
	}
	defer stop()
	var got *events.RolloutNodeResult
	cfg.Results = func(r events.RolloutNodeResult) { got = &r }
	ro, err := fleet.NewRollout(cfg, k.b, act)
	if err != nil {
		return nr, err
	}
	if _, err := ro.Run(ctx); err != nil {
		return nr, err
	}
	if got == nil {
		return nr, errors.New("the rollout reported no outcome")
	}
	return *got, nil
}

// latestAttempt finds the latest attempt of a join that started (0: none did), and returns the first
// attempt's start record with it. Attempts start one after the other, each once the one before ended, so
// the attempts that started are 1 to the latest: it probes attempts 1, 2, 4, 8 ... until one did not start,
// then halves the gap between the last that did and it. That is at most 2*log2(latest)+2 lookups of a start
// record (one each), however long a node has failed.
func (k *keeper) latestAttempt(ctx context.Context, rolloutID, node string, uid types.UID) (latest int, first *events.RolloutStarted, err error) {
	has := func(attempt int) (bool, error) {
		s, err := k.rollouts.started(ctx, JoinAttemptID(rolloutID, node, uid, attempt))
		if attempt == 1 {
			first = s
		}
		return s != nil, err
	}
	ok, err := has(1)
	if err != nil || !ok {
		return 0, nil, err
	}
	lo, hi := 1, 2 // lo started; hi is probed
	for {
		if ok, err = has(hi); err != nil {
			return 0, nil, err
		}
		if !ok {
			break
		}
		lo, hi = hi, 2*hi
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if ok, err = has(mid); err != nil {
			return 0, nil, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, first, nil
}

// attemptRecord is what the bus holds of one attempt of a join.
type attemptRecord struct {
	attempt  int
	started  *events.RolloutStarted
	result   events.RolloutNodeResult
	recorded bool      // result is the node's outcome; otherwise the attempt is at work (or was, when its controller stopped)
	end      time.Time // when it ended, as the outcome tells (zero: not known)
}

// loadAttempt reads attempt attempt of node's join.
func (k *keeper) loadAttempt(ctx context.Context, rolloutID, node string, uid types.UID, attempt int) (attemptRecord, error) {
	started, claims, results, err := k.rollouts.load(ctx, JoinAttemptID(rolloutID, node, uid, attempt))
	if err != nil {
		return attemptRecord{}, err
	}
	r, recorded := results[node]
	rec := attemptRecord{attempt: attempt, started: started, result: r, recorded: recorded}
	if recorded {
		from := timeOf(started)
		if c, ok := claims[node]; ok && !c.Time.IsZero() {
			from = c.Time
		}
		if !from.IsZero() {
			rec.end = from.Add(r.Duration.Duration)
		}
	}
	return rec, nil
}

// awaitAttempt waits until j's next attempt may start: a join not tried yet at once; a failed one once its
// backoff has passed, or at once when poked for it (its node's agent started again), and never while ko is
// paused (a resume pokes it). It reports false when the join ends instead: ko was let go, or j gave way to
// the join of a newer Node of the name.
func (k *keeper) awaitAttempt(ko *keptObject, node string, j *join) bool {
	for {
		k.mu.Lock()
		if ko.joins[node] != j || ko.stopped {
			k.mu.Unlock()
			return false
		}
		hold, due := ko.paused && j.done, j.due
		k.mu.Unlock()
		var fire <-chan time.Time
		var t *time.Timer
		if !hold {
			wait := time.Until(due)
			if wait <= 0 {
				return true
			}
			t = time.NewTimer(wait)
			fire = t.C
		}
		select {
		case <-fire:
		case <-j.wake:
		case <-ko.ctx.Done():
		}
		if t != nil {
			t.Stop()
		}
		if ko.ctx.Err() != nil {
			return false
		}
	}
}

// retryNow has ko's failed join of node tried again at once: its node's agent started again. One at work
// is tried again at once if it fails.
func (k *keeper) retryNow(ko *keptObject, node string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	n, known := k.nodes[node]
	if j := ko.joins[node]; j != nil && !(j.done && j.ok) && !ko.stopped && ko.selects(node, n, known) {
		j.due, j.kicked = time.Time{}, true
		j.poke()
	}
}

// lostRetry reports whether the retry of node's join j, due now, waits instead: node is lost (no heartbeat
// in the registry), so an attempt would only wait out nodeTimeout with one of the keeper's slots. The retry
// is put off by maxJoinRetry; the node's agent starting again (retryNow) tries it at once. A retry its agent's
// start asked for, and a node whose liveness cannot be read, are tried.
func (k *keeper) lostRetry(ko *keptObject, node string, j *join) bool {
	k.mu.Lock()
	retry, kicked := j.done && !j.ok, j.kicked
	k.mu.Unlock()
	if !retry || kicked {
		return false
	}
	alive, err := k.rollouts.alive(ko.ctx, node)
	if err != nil {
		k.log.Warn("reading whether a joined node heartbeats failed; trying its join again", "name", ko.name, "node", node, "err", err)
		return false
	}
	if alive {
		return false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if ko.joins[node] != j || j.kicked {
		return false
	}
	j.due = time.Now().Add(maxJoinRetry)
	k.log.Info("a joined node that failed to warm is lost; its retry waits for its agent to start", "name", ko.name, "node", node,
		"next_look", maxJoinRetry)
	return true
}
