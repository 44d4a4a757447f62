package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// A node's join: the one-node rollout that warms it, its id, its retries and its outcome.

// JoinRolloutID names the one-node rollout that warms a node that joined: <rolloutID>-join-<16 hex digits of
// a SHA-256> (a rollout id holds at most 64 lower-case letters, digits and '-'; a node name more), over the
// node name and the UID of its Kubernetes Node, so that a new Node under a reused name is warmed by a rollout
// of its own. With uid empty (a node with no Kubernetes Node) the hash is of the name alone: the ids that
// joins were recorded under before the UID was part of them, which a controller still reads back.
// `imagefleet fleet follow` shows the node by name.
func JoinRolloutID(rolloutID, node string, uid types.UID) string {
	in := node
	if uid != "" {
		in = node + "\x00" + string(uid)
	}
	sum := sha256.Sum256([]byte(in))
	return rolloutID + "-join-" + hex.EncodeToString(sum[:8])
}

// load reads the first rollout's plan and outcomes: the base of the counters and the planned nodes' warmth.
// A Complete object's planned nodes all ended; one without a success counts as failed.
func (k *keeper) load(ko *keptObject) error {
	started, _, results, err := fleet.LoadRollout(ko.ctx, k.b, ko.rolloutID)
	if err != nil {
		return err
	}
	planned := map[string]bool{}
	var ok int32
	var at time.Time
	if started != nil {
		at = started.Time
		for _, n := range started.Nodes {
			r, has := results[n]
			planned[n] = has && r.OK
			if planned[n] {
				ok++
			}
		}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	ko.planned, ko.plannedAt, ko.baseOK, ko.baseFailed = planned, at, ok, int32(len(planned))-ok
	ko.loading, ko.active = false, true
	return nil
}

// consider takes node on for ko if ko selects it and has not taken its Kubernetes Node on yet (planned it,
// or a join of it). While ko is paused the node is held: taken on when ko resumes.
func (k *keeper) consider(ko *keptObject, node, domain string) {
	id := k.nodeID(ko.ctx, node)
	k.mu.Lock()
	n, known := k.nodes[node]
	if !ko.active || ko.stopped || !ko.selects(node, n, known) || ko.hasOutcomeLocked(node, id) {
		k.mu.Unlock()
		return
	}
	if ko.paused {
		if ko.held == nil {
			ko.held = map[string]string{}
		}
		ko.held[node] = domain
		k.mu.Unlock()
		return
	}
	k.takeOnLocked(ko, node, domain, newJoin(id.uid, time.Time{}))
	k.mu.Unlock()
}

// takeOnLocked makes j ko's join of node and starts its attempts. A join of an earlier Node of the name gives
// way: its outcome is not this Node's, and its retries end. k.mu is held.
func (k *keeper) takeOnLocked(ko *keptObject, node, domain string, j *join) {
	if old := ko.joins[node]; old != nil {
		old.poke()
	}
	ko.joins[node] = j
	ko.dirty = true
	k.wg.Add(1)
	go func() {
		defer k.wg.Done()
		k.warm(ko, node, domain, j)
	}()
}

// warm runs node's attempts for ko, one after the other until one succeeds (or the join ends): each reads
// its recorded outcome, or runs (resumes) its one-node rollout, and records the outcome. A failed attempt is
// followed by the next after its backoff (awaitAttempt). Each attempt waits for its turn among the joins at
// work; a first attempt that waited for it while ko was paused is held again instead, a retry waits for the
// resume.
func (k *keeper) warm(ko *keptObject, node, domain string, j *join) {
	for k.awaitAttempt(ko, node, j) {
		if k.lostRetry(ko, node, j) {
			continue
		}
		select {
		case k.sem <- struct{}{}:
		case <-ko.ctx.Done():
			return
		}
		k.mu.Lock()
		if ko.joins[node] != j || ko.stopped {
			k.mu.Unlock()
			<-k.sem
			return
		}
		if ko.paused {
			if !j.done {
				delete(ko.joins, node)
				if ko.held == nil {
					ko.held = map[string]string{}
				}
				ko.held[node], ko.dirty = domain, true
				k.mu.Unlock()
				<-k.sem
				return
			}
			k.mu.Unlock()
			<-k.sem
			continue
		}
		attempt := j.next
		if n, known := k.nodes[node]; attempt > 1 && !ko.selects(node, n, known) {
			// Relabelled out of the object's selection since it failed: not tried again (its failure stays).
			k.mu.Unlock()
			<-k.sem
			k.log.Info("a joined node that failed to warm is no longer selected; not trying it again", "name", ko.name, "node", node)
			return
		}
		j.kicked = false
		if n, ok := k.nodes[node]; ok && n.domain != "" {
			domain = n.domain // its agent may have started again elsewhere
		}
		k.mu.Unlock()
		id := JoinAttemptID(ko.rolloutID, node, j.uid, attempt)
		var nr events.RolloutNodeResult
		var fresh bool
		ok := untilDone(ko.ctx, func() (err error) {
			nr, fresh, err = k.warmOnce(ko, id, node, domain, attempt)
			return err
		}, func(err error, wait time.Duration) {
			k.log.Warn("warming a joined node failed; resuming it", "name", ko.name, "node", node, "rollout", id, "attempt", attempt, "err", err, "after", wait)
		})
		<-k.sem
		if !ok || !k.ended(ko, node, j, attempt, nr, fresh, time.Now()) {
			return
		}
		k.log.Info("a joined node failed to warm; trying it again", "name", ko.name, "node", node, "rollout", id, "attempt", attempt,
			"err", nr.Error)
	}
}

// untilDone runs op until it succeeds or ctx ends, 1 s apart doubling to 1 min, telling failed of each
// failure (not of one ctx ended) and the wait before the next try. It reports whether op succeeded.
func untilDone(ctx context.Context, op func() error, failed func(err error, wait time.Duration)) bool {
	for wait := time.Second; ; wait = min(2*wait, time.Minute) {
		err := op()
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		failed(err, wait)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return false
		}
	}
}

// warmOnce reads the outcome of node's attempt (rollout id), or runs (resumes) it. fresh is false for an
// outcome recorded before: nothing new happened to the node.
func (k *keeper) warmOnce(ko *keptObject, id, node, domain string, attempt int) (nr events.RolloutNodeResult, fresh bool, err error) {
	started, _, results, err := k.rollouts.load(ko.ctx, id)
	if err != nil {
		return nr, false, err
	}
	if r, ok := results[node]; ok {
		return r, false, nil
	}
	if started == nil {
		if attempt > 1 {
			k.event(ko.obj, corev1.EventTypeNormal, "NodeJoined", "Node %s joined: warming it (rollout %s, attempt %d)", node, id, attempt)
		} else {
			k.event(ko.obj, corev1.EventTypeNormal, "NodeJoined", "Node %s joined: warming it (rollout %s)", node, id)
		}
	}
	nr, err = k.rollouts.run(ko, id, node, domain)
	if err != nil {
		return nr, false, err
	}
	return nr, !nr.Resumed, nil
}

// ended records the outcome of attempt attempt of node's join j, ended at end: the counters, the failure
// and when to try again, and the taint. A node counts once: failed (and in failedNodes) while its attempts
// fail, succeeded (and out of failedNodes) once one succeeds. A Warning Event NodeFailed tells of a new
// failure: the join's first, or a later one whose reason changed. A join that gave way to one of a newer
// Node of the name records nothing. It reports whether the join is to be tried again.
func (k *keeper) ended(ko *keptObject, node string, j *join, attempt int, nr events.RolloutNodeResult, fresh bool, end time.Time) (retry bool) {
	k.mu.Lock()
	if ko.joins[node] != j || ko.stopped {
		k.mu.Unlock()
		return false
	}
	first, prev := !j.done, j.reason
	j.done, j.ok = true, nr.OK
	ko.dirty = true
	if nr.OK {
		j.reason = ""
		if attempt > 1 { // the failure listed is this join's
			ko.failedNodes = slices.DeleteFunc(ko.failedNodes, func(f v1alpha1.NodeFailure) bool { return f.Node == node })
		}
	} else {
		j.reason, j.next, j.due = nr.Error, attempt+1, end.Add(joinBackoff(attempt))
		if j.kicked { // left set: the retry is its agent's start's, which lostRetry lets through
			j.due = time.Time{}
		}
		if i := slices.IndexFunc(ko.failedNodes, func(f v1alpha1.NodeFailure) bool { return f.Node == node }); i >= 0 {
			ko.failedNodes[i].Reason = nr.Error
		} else if len(ko.failedNodes) < maxFailedNodes {
			ko.failedNodes = append(ko.failedNodes, v1alpha1.NodeFailure{Node: node, Reason: nr.Error})
		}
	}
	k.mu.Unlock()
	switch {
	case nr.OK:
		k.kickNode(node)
	case fresh && (first || nr.Error != prev):
		if attempt > 1 {
			k.event(ko.obj, corev1.EventTypeWarning, "NodeFailed", "Node %s: %s (attempt %d)", node, nr.Error, attempt)
		} else {
			k.event(ko.obj, corev1.EventTypeWarning, "NodeFailed", "Node %s: %s", node, nr.Error)
		}
	}
	return !nr.OK
}
