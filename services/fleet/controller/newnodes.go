package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// New nodes: an ImagePrePull with completionPolicy KeepNewNodes keeps warming the nodes that join the fleet
// after its first rollout completed.
//
// The keeper is one per controller, shared by every such object. It watches the registry's last-seen bucket
// (events.NodesSeenBucket: a node's full record is written at its first heartbeat, when it changes, and every
// few minutes; not every heartbeat): a record of a node it had not seen, or of a node whose agent started
// again, after the bucket's initial values, is a node joining. A node that joins and that an object selects,
// and that was not in the object's first rollout, is warmed by a one-node rollout of its own, id
// JoinRolloutID(<rolloutID>, node, <its Kubernetes Node's UID>), through the same engine (fleet.NewRollout):
// its claim and outcome are on the bus, so a controller that restarts reads the outcome back (LoadRollout)
// instead of pulling again, and resumes a join that was at work. Nodes that joined while no controller ran
// are found when an object is taken on (activate): the registry's Ready nodes that match, less the first
// rollout's; and again when the registry watch has passed its initial values (registryEntry).
//
// An outcome is of one Kubernetes Node (nodeID): a Node made again under a reused name is a new node. A
// paused object takes no node on: the nodes that join meanwhile are held, and taken on when it resumes. A
// failed join is not tried again by its object (docs/kubernetes-objects.md says how to retry one).
//
// The keeper also removes each object's readiness taint from the Kubernetes Nodes it warmed (readiness.go).
//
// Lock order: keeper.mu is taken alone, never while a reconciler's or a runner's lock is held, nor the other
// way round.
type keeper struct {
	b      *bus.Bus
	kind   kind
	cfg    Config
	log    *slog.Logger
	c      client.Client            // the manager's (cached) client: Nodes, for the taint
	api    client.Reader            // uncached reads: a Node before its taint is removed
	status client.SubResourceWriter // the objects' status
	rec    recorder.EventRecorder   // Events on the objects and the Nodes
	kick   chan event.GenericEvent  // Nodes whose readiness taint to look at again
	base   context.Context          // Run's: the joins end with the controller
	wg     sync.WaitGroup           // the joins and activations at work
	sem    chan struct{}            // bounds the joins at work at once
	mu     sync.Mutex               // guards objects, nodes, synced and every keptObject's fields
	synced bool                     // the registry watch passed its initial values
	nodes  map[string]registryNode  // the registry's nodes, as their last-seen records show them
	objs   map[string]*keptObject   // by object name

	// scan takes on the nodes of the registry for an object (scanRegistry; a test's fake stands in).
	scan func(ko *keptObject) error
}

// maxJoinsAtWork bounds the one-node rollouts the keeper runs at once (a burst of joins waits its turn).
const maxJoinsAtWork = 64

// registryNode is what the keeper keeps of a node's registry record.
type registryNode struct {
	labels  labels.Set
	domain  string
	started time.Time
}

// keptObject is one KeepNewNodes ImagePrePull as the keeper follows it.
type keptObject struct {
	name      string
	uid       types.UID
	obj       *v1alpha1.ImagePrePull // as first seen: the spec (immutable but for pause) and the Events' subject
	rolloutID string
	key       string          // the readiness taint
	sel       labels.Selector // nil with names
	names     map[string]bool

	loading, active bool // the first rollout's outcomes are being read / were read: joins may start
	settled         bool // the joins recorded before were read: the counters may be written
	stopped         bool // forgotten: its joins end
	ctx             context.Context
	cancel          context.CancelFunc

	paused bool              // spec.paused: no join starts
	held   map[string]string // the nodes that joined while paused, with their JetStream domains

	planned            map[string]bool // the first rollout's nodes: true for those warmed
	plannedAt          time.Time       // the first rollout's start: its outcomes are of the Nodes made before
	baseOK, baseFailed int32
	joins              map[string]*join
	failedNodes        []v1alpha1.NodeFailure
	dirty              bool
}

// join is one joined node's warm-up.
type join struct {
	done, ok bool
	uid      types.UID // the Kubernetes Node's it warms ("": no such Node, or a join recorded under the name only)
	started  time.Time // its rollout's start, for a join recorded under the name only
}

// nodeID tells the Kubernetes Nodes of one name apart: a Node deleted and made again under its name (a new
// machine) has another UID and a later creation time. The zero nodeID is a node with no Kubernetes Node (or
// none read yet): the name is all there is.
type nodeID struct {
	uid     types.UID
	created time.Time
}

// covers reports whether an outcome is of id's Node: one recorded for the Node's UID, or, for an outcome
// recorded under the name only (the first rollout's, and joins recorded before the UID was), one whose
// rollout started after the Node was made (to the second: the API server's creation time has no finer grain).
func (id nodeID) covers(uid types.UID, started time.Time) bool {
	switch {
	case id.uid == "":
		return true
	case uid != "":
		return uid == id.uid
	default:
		return !started.IsZero() && !started.Before(id.created)
	}
}

func newKeeper(base context.Context, cfg Config, b *bus.Bus, k kind, c client.Client, api client.Reader, status client.SubResourceWriter, rec recorder.EventRecorder) *keeper {
	kp := &keeper{b: b, kind: k, cfg: cfg, log: cfg.Logger.With("worker", "controller", "part", "new-nodes"), c: c, api: api,
		status: status, rec: rec, kick: make(chan event.GenericEvent, 1024), base: base, sem: make(chan struct{}, maxJoinsAtWork),
		nodes: map[string]registryNode{}, objs: map[string]*keptObject{}}
	kp.scan = kp.scanRegistry
	return kp
}

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

// keepsNewNodes reports whether obj is an ImagePrePull with completionPolicy KeepNewNodes.
func keepsNewNodes(obj client.Object) (*v1alpha1.ImagePrePull, bool) {
	o, ok := obj.(*v1alpha1.ImagePrePull)
	return o, ok && o.Spec.CompletionPolicy == v1alpha1.CompletionKeepNewNodes
}

// readinessTaint is o's taint key.
func readinessTaint(o *v1alpha1.ImagePrePull) string {
	if o.Spec.ReadinessTaint != "" {
		return o.Spec.ReadinessTaint
	}
	return v1alpha1.DefaultReadinessTaint
}

// observe takes the object as the reconciler last read it: a KeepNewNodes object is followed from its
// creation (while its first rollout runs it holds the taint of the nodes it selects) and takes on joining
// nodes once it completed; a failed one, or any other, is let go.
func (k *keeper) observe(obj client.Object) {
	if k == nil {
		return
	}
	o, keep := keepsNewNodes(obj)
	if !keep || meta.IsStatusConditionTrue(o.Status.Conditions, v1alpha1.ConditionFailed) {
		k.forget(obj.GetName())
		return
	}
	k.mu.Lock()
	ko := k.objs[o.Name]
	if ko != nil && ko.uid != o.UID {
		k.stopLocked(ko)
		ko = nil
	}
	fresh := ko == nil
	if fresh {
		var err error
		if ko, err = newKeptObject(k.base, o); err != nil {
			k.mu.Unlock()
			k.log.Warn("object not followed for new nodes", "name", o.Name, "err", err)
			return
		}
		k.objs[o.Name] = ko
	}
	if ko.rolloutID == "" {
		ko.rolloutID = o.Status.RolloutID
	}
	var resumed map[string]string
	if ko.paused && !o.Spec.Paused {
		resumed, ko.held = ko.held, nil
	}
	ko.paused = o.Spec.Paused
	start := meta.IsStatusConditionTrue(o.Status.Conditions, v1alpha1.ConditionComplete) && !ko.active && !ko.loading && ko.rolloutID != ""
	if start {
		ko.loading = true
		ko.failedNodes = append([]v1alpha1.NodeFailure(nil), o.Status.FailedNodes...)
		k.wg.Add(1)
	}
	k.mu.Unlock()
	if start {
		go func() {
			defer k.wg.Done()
			k.activate(ko)
		}()
	}
	for node, domain := range resumed {
		k.consider(ko, node, domain)
	}
	if fresh {
		k.kickAll() // an object in its first rollout holds the taint of the nodes it selects
	}
}

func newKeptObject(base context.Context, o *v1alpha1.ImagePrePull) (*keptObject, error) {
	ko := &keptObject{name: o.Name, uid: o.UID, obj: o.DeepCopy(), key: readinessTaint(o), joins: map[string]*join{}, paused: o.Spec.Paused}
	switch {
	case len(o.Spec.Nodes.Names) > 0:
		ko.names = map[string]bool{}
		for _, n := range o.Spec.Nodes.Names {
			ko.names[n] = true
		}
	case o.Spec.Nodes.Selector != nil:
		sel, err := metav1.LabelSelectorAsSelector(o.Spec.Nodes.Selector)
		if err != nil {
			return nil, fmt.Errorf("nodes.selector: %w", err)
		}
		ko.sel = sel
	default:
		ko.sel = labels.Everything()
	}
	ko.ctx, ko.cancel = context.WithCancel(base)
	return ko, nil
}

// selects reports whether ko takes node: by name, or by its registry labels. A node the registry does not
// show (its agent never heartbeated) is taken as selected: its taint stays until the agent registers.
func (ko *keptObject) selects(node string, n registryNode, known bool) bool {
	if ko.names != nil {
		return ko.names[node]
	}
	return !known || ko.sel.Matches(n.labels)
}

// warmed reports whether ko warmed node's Node id: in its first rollout, or as it joined.
func (ko *keptObject) warmed(node string, id nodeID) bool {
	if ok, planned := ko.planned[node]; planned && id.covers("", ko.plannedAt) {
		return ok
	}
	j := ko.joins[node]
	return j != nil && j.done && j.ok && id.covers(j.uid, j.started)
}

// hasOutcomeLocked reports whether ko took node's Node id on already: it planned it, or it has a join of it
// (at work, or ended with either outcome). k.mu is held.
func (ko *keptObject) hasOutcomeLocked(node string, id nodeID) bool {
	if _, planned := ko.planned[node]; planned && id.covers("", ko.plannedAt) {
		return true
	}
	j := ko.joins[node]
	return j != nil && (j.uid == id.uid || (j.done && id.covers(j.uid, j.started)))
}

// forget lets the object of name go: its joins end (each resumes if the object is taken on again).
func (k *keeper) forget(name string) {
	if k == nil {
		return
	}
	k.mu.Lock()
	ko := k.objs[name]
	if ko != nil {
		k.stopLocked(ko)
	}
	k.mu.Unlock()
	if ko != nil {
		k.kickAll() // the nodes it held may be free now
	}
}

func (k *keeper) stopLocked(ko *keptObject) {
	ko.stopped = true
	ko.cancel()
	if k.objs[ko.name] == ko {
		delete(k.objs, ko.name)
	}
}

// stop ends every object's joins and waits for them (the controller stops or lost its Lease).
func (k *keeper) stop() {
	k.mu.Lock()
	for _, ko := range k.objs {
		k.stopLocked(ko)
	}
	k.mu.Unlock()
	k.wg.Wait()
}

// activate reads the object's first rollout (its nodes, and which were warmed), then takes on the nodes that
// joined since: the registry's Ready nodes that match, less the first rollout's. Retried until it works or
// the object is let go.
func (k *keeper) activate(ko *keptObject) {
	if !untilDone(ko.ctx, func() error { return k.load(ko) }, func(err error, wait time.Duration) {
		k.log.Warn("reading the first rollout failed; retrying", "name", ko.name, "rollout", ko.rolloutID, "err", err, "after", wait)
	}) {
		return
	}
	k.kickAll()
	if !k.rescan(ko) {
		return
	}
	k.mu.Lock()
	ko.settled, ko.dirty = true, true
	k.mu.Unlock()
}

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
// id), which counts if it started after the Node was made.
func (k *keeper) adopt(ko *keptObject, node, domain string, ready bool) error {
	id := k.nodeID(ko.ctx, node)
	k.mu.Lock()
	skip := ko.hasOutcomeLocked(node, id) || ko.stopped || (ko.names != nil && !ko.names[node])
	k.mu.Unlock()
	if skip {
		return nil
	}
	started, _, results, err := fleet.LoadRollout(ko.ctx, k.b, JoinRolloutID(ko.rolloutID, node, id.uid))
	if err != nil {
		return err
	}
	r, recorded := results[node]
	j := &join{uid: id.uid, started: timeOf(started)}
	if !recorded && id.uid != "" {
		started, _, results, err = fleet.LoadRollout(ko.ctx, k.b, JoinRolloutID(ko.rolloutID, node, ""))
		if err != nil {
			return err
		}
		r, recorded = results[node]
		j = &join{started: timeOf(started)}
		recorded = recorded && id.covers("", j.started)
	}
	if !recorded {
		if ready {
			k.consider(ko, node, domain)
		}
		return nil
	}
	k.mu.Lock()
	if !ko.hasOutcomeLocked(node, id) {
		ko.joins[node] = j
		k.mu.Unlock()
		k.ended(ko, node, j, r, false)
		return nil
	}
	k.mu.Unlock()
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

// selectorString is ko's selector as a join rollout records it ("" for names).
func selectorString(ko *keptObject) string {
	if ko.sel == nil {
		return ""
	}
	return ko.sel.String()
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
// started again, is taken on by every object that selects it.
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
	}
	if !known && joined {
		k.kickNode(node) // its labels are known now: the objects that select it are too
	}
}

// flusher writes each changed object's counters, at most every StatusInterval.
func (k *keeper) flusher(ctx context.Context) {
	t := time.NewTicker(k.cfg.StatusInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		k.mu.Lock()
		var todo []*keptObject
		for _, ko := range k.objs {
			if ko.dirty && ko.settled {
				todo = append(todo, ko)
			}
		}
		k.mu.Unlock()
		for _, ko := range todo {
			if err := k.flush(ctx, ko); err != nil && ctx.Err() == nil {
				k.log.Warn("status write failed; retrying", "name", ko.name, "err", err)
			}
		}
	}
}

// keptCounts are an object's counters with its joined nodes.
type keptCounts struct {
	Desired     int32                  `json:"desired"`
	Active      int32                  `json:"active"`
	Succeeded   int32                  `json:"succeeded"`
	Failed      int32                  `json:"failed"`
	Joined      int32                  `json:"joined"`
	Progress    string                 `json:"progress"`
	FailedNodes []v1alpha1.NodeFailure `json:"failedNodes,omitempty"`
}

// countsLocked sums ko's counters: the first rollout's, plus each joined node (desired and joined as it is
// taken on, succeeded or failed as it ends, active while it is at work). k.mu is held.
func (ko *keptObject) countsLocked() keptCounts {
	c := keptCounts{Succeeded: ko.baseOK, Failed: ko.baseFailed, Joined: int32(len(ko.joins)),
		FailedNodes: append([]v1alpha1.NodeFailure(nil), ko.failedNodes...)}
	for _, j := range ko.joins {
		switch {
		case !j.done:
			c.Active++
		case j.ok:
			c.Succeeded++
		default:
			c.Failed++
		}
	}
	c.Desired = int32(len(ko.planned)) + c.Joined
	c.Progress = fmt.Sprintf("%d/%d", c.Succeeded+c.Failed, c.Desired)
	return c
}

// flush writes ko's counters: a merge patch of the status, conditioned on the object's UID (the first
// rollout's runner has ended: it writes no more).
func (k *keeper) flush(ctx context.Context, ko *keptObject) error {
	k.mu.Lock()
	c := ko.countsLocked()
	ko.dirty = false
	k.mu.Unlock()
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"uid": ko.uid}, "status": c})
	if err == nil {
		obj := &v1alpha1.ImagePrePull{}
		obj.SetName(ko.name)
		err = k.status.Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch))
	}
	if err != nil {
		k.mu.Lock()
		ko.dirty = true
		k.mu.Unlock()
		return fmt.Errorf("patch status of %s: %w", ko.name, err)
	}
	return nil
}

func (k *keeper) event(obj client.Object, eventType, reason, note string, args ...any) {
	k.rec.Eventf(obj, nil, eventType, reason, reason, note, args...)
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
