package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
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
	j := &join{uid: id.uid}
	ko.joins[node] = j // a join of an earlier Node of the name gives way: its outcome is not this Node's
	ko.dirty = true
	k.wg.Add(1)
	k.mu.Unlock()
	go func() {
		defer k.wg.Done()
		k.warm(ko, node, domain, j)
	}()
}

// warm runs node's one-node rollout for ko, or reads its recorded outcome, and records the outcome. A join
// that waited for its turn while ko was paused is held again instead.
func (k *keeper) warm(ko *keptObject, node, domain string, j *join) {
	select {
	case k.sem <- struct{}{}:
	case <-ko.ctx.Done():
		return
	}
	defer func() { <-k.sem }()
	k.mu.Lock()
	if ko.paused && ko.joins[node] == j {
		delete(ko.joins, node)
		if ko.held == nil {
			ko.held = map[string]string{}
		}
		ko.held[node], ko.dirty = domain, true
		k.mu.Unlock()
		return
	}
	k.mu.Unlock()
	id := JoinRolloutID(ko.rolloutID, node, j.uid)
	var nr events.RolloutNodeResult
	var fresh bool
	if untilDone(ko.ctx, func() (err error) {
		nr, fresh, err = k.warmOnce(ko, id, node, domain)
		return err
	}, func(err error, wait time.Duration) {
		k.log.Warn("warming a joined node failed; resuming it", "name", ko.name, "node", node, "rollout", id, "err", err, "after", wait)
	}) {
		k.ended(ko, node, j, nr, fresh)
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

// warmOnce reads node's recorded outcome, or runs (resumes) its rollout. fresh is false for an outcome
// recorded before: nothing new happened to the node.
func (k *keeper) warmOnce(ko *keptObject, id, node, domain string) (nr events.RolloutNodeResult, fresh bool, err error) {
	ctx := ko.ctx
	started, _, results, err := fleet.LoadRollout(ctx, k.b, id)
	if err != nil {
		return nr, false, err
	}
	if r, ok := results[node]; ok {
		return r, false, nil
	}
	if started == nil {
		k.event(ko.obj, corev1.EventTypeNormal, "NodeJoined", "Node %s joined: warming it (rollout %s)", node, id)
	}
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
		return nr, false, err
	}
	defer stop()
	var got *events.RolloutNodeResult
	cfg.Results = func(r events.RolloutNodeResult) { got = &r }
	ro, err := fleet.NewRollout(cfg, k.b, act)
	if err != nil {
		return nr, false, err
	}
	if _, err := ro.Run(ctx); err != nil {
		return nr, false, err
	}
	if got == nil {
		return nr, false, errors.New("the rollout reported no outcome")
	}
	return *got, !got.Resumed, nil
}

// ended records the outcome of node's join j: the counters, the failure (a new one: an Event), and the
// taint. A join that gave way to one of a newer Node of the name records nothing.
func (k *keeper) ended(ko *keptObject, node string, j *join, nr events.RolloutNodeResult, fresh bool) {
	k.mu.Lock()
	if ko.joins[node] != j || ko.stopped {
		k.mu.Unlock()
		return
	}
	j.done, j.ok = true, nr.OK
	ko.dirty = true
	if !nr.OK && len(ko.failedNodes) < maxFailedNodes && !hasFailure(ko.failedNodes, node) {
		ko.failedNodes = append(ko.failedNodes, v1alpha1.NodeFailure{Node: node, Reason: nr.Error})
	}
	k.mu.Unlock()
	switch {
	case nr.OK:
		k.kickNode(node)
	case fresh:
		k.event(ko.obj, corev1.EventTypeWarning, "NodeFailed", "Node %s: %s", node, nr.Error)
	}
}
