package controller

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
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
// A failed join is tried again, without end (a pre-pull is idempotent): 30 s after the failure, doubling to
// 10 min apart (joinBackoff), not while the node is lost (lostRetry), and at once when the node's agent
// starts again (registryEntry). Each attempt is
// a one-node rollout of its own, JoinAttemptID(<rolloutID>, node, uid, k), the first with the join's id, so
// the engine's promise (no node acted on twice within a rollout id) holds per attempt; a controller that
// restarts finds the latest attempt (latestAttempt, in a number of lookups logarithmic in it) and goes on
// from it (adopt). A node counts once: failed, and in failedNodes, until an attempt succeeds.
//
// An outcome is of one Kubernetes Node (nodeID): a Node made again under a reused name is a new node. A
// paused object takes no node on: the nodes that join meanwhile are held, and taken on when it resumes; a
// failed join's retry waits for the resume too. The attempts at work, first ones and retries, are bounded
// together (maxJoinsAtWork).
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
	// rollouts reads and runs the joins' rollouts (busJoins; a test's fake stands in).
	rollouts joinRollouts
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

// join is one joined node's warm-up: its attempts, one after the other until one succeeds.
type join struct {
	done, ok bool          // an attempt ended; the latest that ended succeeded
	uid      types.UID     // the Kubernetes Node's it warms ("": no such Node, or a join recorded under the name only)
	started  time.Time     // its first attempt's start, for a join recorded under the name only
	next     int           // the attempt at work, or the one to run next (1 the first)
	due      time.Time     // a failed join: when attempt next may start
	kicked   bool          // its node's agent started again while an attempt was at work: retry at once
	reason   string        // the latest failure's reason (a NodeFailed Event when it changes)
	wake     chan struct{} // has its attempts' loop look again (poke)
}

func newJoin(uid types.UID, started time.Time) *join {
	return &join{uid: uid, started: started, next: 1, wake: make(chan struct{}, 1)}
}

// poke has j's attempts' loop look again at its state: the object resumed, the node's agent started again,
// or j gave way.
func (j *join) poke() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
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
	kp.rollouts = busJoins{kp}
	return kp
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
		for _, j := range ko.joins {
			j.poke() // a failed join's retry was held
		}
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

// selectorString is ko's selector as a join rollout records it ("" for names).
func selectorString(ko *keptObject) string {
	if ko.sel == nil {
		return ""
	}
	return ko.sel.String()
}
