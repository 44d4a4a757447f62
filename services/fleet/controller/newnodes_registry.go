package controller

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// The keeper's view of the node registry: the watch of the last-seen bucket, the scans, and the Node a
// registry entry stands for.

// rescan runs k.scan for ko until it works or ko is let go, and reports whether it worked.
func (k *keeper) rescan(ko *keptObject) bool {
	return untilDone(ko.ctx, func() error { return k.scan(ko) }, func(err error, wait time.Duration) {
		k.log.Warn("reading the registry failed; retrying", "name", ko.name, "err", err, "after", wait)
	})
}

// scan takes on the nodes that joined before: each matching node of the registry, Ready or lost, that the
// first rollout did not plan. A node whose join recorded an outcome is counted with it, read here before the
// counters are first written (a controller that restarts writes no dip in them); a Ready one without is
// warmed.
func (k *keeper) scanRegistry(ko *keptObject) error {
	reg, err := fleet.OpenRegistry(ko.ctx, k.b, fleet.RegistryOptions{})
	if err != nil {
		return err
	}
	page, err := reg.List(ko.ctx, fleet.NodeQuery{Selector: ko.sel})
	if err != nil {
		return err
	}
	for _, n := range page.Nodes {
		if err := k.adopt(ko, n.Node, n.JSDomain, n.State == events.NodeReady); err != nil {
			return err
		}
	}
	return nil
}

// adopt counts node's recorded join, or takes a Ready node on. The join is looked up under the id of the
// node's Kubernetes Node, then under the node's name only (a join recorded before the UID was part of the
// id), which counts if it started after the Node was made. Of a join it reads the latest attempt
// (latestAttempt): a succeeded one is counted; a failed one is counted and tried again after its backoff,
// measured from its end; one at work is resumed (at once), the failure before it counted. A join whose
// first attempt is at work is taken on as a Ready node without one is, and resumes it.
func (k *keeper) adopt(ko *keptObject, node, domain string, ready bool) error {
	id := k.nodeID(ko.ctx, node)
	k.mu.Lock()
	skip := ko.hasOutcomeLocked(node, id) || ko.stopped || (ko.names != nil && !ko.names[node])
	k.mu.Unlock()
	if skip {
		return nil
	}
	uid := id.uid
	latest, first, err := k.latestAttempt(ko.ctx, ko.rolloutID, node, uid)
	if err != nil {
		return err
	}
	if latest == 0 && uid != "" {
		uid = ""
		if latest, first, err = k.latestAttempt(ko.ctx, ko.rolloutID, node, ""); err != nil {
			return err
		}
		if !id.covers("", timeOf(first)) {
			latest = 0
		}
	}
	var last, before attemptRecord
	if latest > 0 {
		if last, err = k.loadAttempt(ko.ctx, ko.rolloutID, node, uid, latest); err != nil {
			return err
		}
	}
	if latest > 1 && !last.recorded {
		if before, err = k.loadAttempt(ko.ctx, ko.rolloutID, node, uid, latest-1); err != nil {
			return err
		}
		if !before.recorded { // its records are gone from the stream
			before.result = events.RolloutNodeResult{Node: node, Error: "no outcome recorded"}
		}
	}
	if latest == 0 || (latest == 1 && !last.recorded) {
		if ready {
			k.consider(ko, node, domain)
		}
		return nil
	}
	j := newJoin(uid, timeOf(first))
	k.mu.Lock()
	if ko.hasOutcomeLocked(node, id) || ko.stopped {
		k.mu.Unlock()
		return nil
	}
	ko.joins[node] = j
	k.mu.Unlock()
	rec := last
	if !last.recorded {
		rec = before
	}
	end := rec.end
	if end.IsZero() {
		end = time.Now()
	}
	if !k.ended(ko, node, j, rec.attempt, rec.result, false, end) {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if ko.joins[node] != j || ko.stopped {
		return nil
	}
	if !last.recorded {
		j.next, j.due = latest, time.Time{} // at work when its controller stopped: resumed at once
	}
	k.takeOnLocked(ko, node, domain, j)
	return nil
}

func timeOf(started *events.RolloutStarted) time.Time {
	if started == nil {
		return time.Time{}
	}
	return started.Time
}

// nodeID reads the Kubernetes Node of node from the cache: the zero nodeID if there is none.
func (k *keeper) nodeID(ctx context.Context, node string) nodeID {
	n := &corev1.Node{}
	if err := k.c.Get(ctx, client.ObjectKey{Name: node}, n); err != nil {
		if !apierrors.IsNotFound(err) && ctx.Err() == nil {
			k.log.Warn("reading the Node failed; taking the node by its name", "node", node, "err", err)
		}
		return nodeID{}
	}
	return nodeID{uid: n.UID, created: n.CreationTimestamp.Time}
}

// Start watches the registry for joining nodes and writes the objects' counters; it blocks until ctx ends
// (a manager Runnable: on the Lease's holder only).
func (k *keeper) Start(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		defer close(done)
		k.flusher(ctx)
	}()
	defer func() { <-done }()
	for wait := time.Second; ; wait = min(2*wait, 30*time.Second) {
		kv, err := k.b.KVExisting(ctx, events.NodesSeenBucket)
		if err == nil {
			err = kv.Watch(ctx, ">", k.registryEntry)
		}
		if ctx.Err() != nil {
			return nil
		}
		if !errors.Is(err, bus.ErrBucketNotFound) {
			k.log.Warn("watching the node registry failed; watching again", "err", err, "after", wait)
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil
		}
	}
}

// registryEntry takes one last-seen record: after the initial values, a node not seen before, or whose agent
// started again, is taken on by every object that selects it, and a failed join of it is tried again at once.
func (k *keeper) registryEntry(e bus.Entry, initialDone bool) {
	if initialDone {
		// A node written after an object's scan read the registry and before the watch passed its initial
		// values came as an initial value, not as a join: each object whose scan may have run before now
		// scans again. One that activates later scans after this.
		k.mu.Lock()
		k.synced = true
		for _, ko := range k.objs {
			if ko.active && !ko.stopped {
				k.wg.Add(1)
				go func() {
					defer k.wg.Done()
					k.rescan(ko)
				}()
			}
		}
		k.mu.Unlock()
		k.kickAll()
		return
	}
	node := events.NodeFromToken(e.Key)
	if e.Deleted {
		k.mu.Lock()
		delete(k.nodes, node)
		k.mu.Unlock()
		return
	}
	var info events.NodeInfo
	if json.Unmarshal(e.Value, &info) != nil {
		return // a foreign or damaged value is not a node
	}
	if info.Node != "" {
		node = info.Node
	}
	n := registryNode{labels: labels.Set(info.Labels), domain: info.JSDomain, started: info.Started}
	k.mu.Lock()
	prev, known := k.nodes[node]
	k.nodes[node] = n
	joined := k.synced && (!known || !prev.started.Equal(n.started))
	var objs []*keptObject
	if joined {
		for _, ko := range k.objs {
			objs = append(objs, ko)
		}
	}
	k.mu.Unlock()
	for _, ko := range objs {
		k.consider(ko, node, n.domain)
		k.retryNow(ko, node) // a failed join of the node is tried again at once
	}
	if !known && joined {
		k.kickNode(node) // its labels are known now: the objects that select it are too
	}
}

// readyNames plans a KeepNewNodes object's first rollout over names: the named nodes the registry shows
// Ready, in the names' order; the others are skipped, and warmed when they join.
func readyNames(ctx context.Context, b *bus.Bus, names []string) ([]string, []events.RolloutNodeError, map[string]string, error) {
	p, err := fleet.Plan(ctx, b, "", false, time.Now)
	if err != nil {
		return nil, nil, nil, err
	}
	ready := map[string]bool{}
	for _, n := range p.Nodes {
		ready[n] = true
	}
	var nodes []string
	var skipped []events.RolloutNodeError
	for _, n := range names {
		if ready[n] {
			nodes = append(nodes, n)
		} else {
			skipped = append(skipped, events.RolloutNodeError{Node: n, Error: "not Ready in the registry: warmed when it joins"})
		}
	}
	return nodes, skipped, p.Domains, nil
}
