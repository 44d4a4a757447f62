package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// policySync delivers the ImageGCPolicy objects to the nodes (docs/gc-policies.md). It is level-based and
// global: every sync lists the policies and the registry's nodes, computes each node's effective policy
// (effectivePolicy), writes the keys of events.GCPolicyBucket whose value changed, deletes the keys of
// nodes no policy selects, and writes each policy's status. An event on any policy asks for a sync; the
// leader also syncs at its start and every PolicyResync (nodes that joined or changed labels).
//
// A policy whose current generation checkPolicy refuses keeps its last valid generation in force (applied,
// and the object's status.appliedSpec for a leader that did not see it). A node whose merge it would
// refuse (checkMerge) keeps the value it has: its key is neither written nor deleted.
type policySync struct {
	c      client.Client
	status client.SubResourceWriter
	b      *bus.Bus
	rec    recorder.EventRecorder
	log    *slog.Logger
	m      *metrics
	resync time.Duration
	kick   chan struct{}

	// Only the sync loop touches these.
	kv      *bus.KV
	reg     *fleet.Registry
	written map[string][]byte // the bucket's values, as last read or written; nil: read it again
	resyncs int               // periodic resyncs since written was last dropped
	// applied is, per policy object, the last generation whose spec passed checkPolicy. Its durable copy is
	// the object's status (appliedGeneration, appliedSpec): the simplest store that a new leader reads
	// anyway (the list it syncs from), that goes with the object when it is deleted, that shows an operator
	// which generation is in force, and that needs no bucket or NATS permission of its own.
	applied map[types.UID]appliedPolicy
}

// policyReread is how many periodic resyncs pass before the sync reads the bucket again rather than trust
// written: a leader that lost the Lease and got it back, or a write by another replica while this one
// was not the leader, would otherwise leave a node's key stale until the policies change.
const policyReread = 10

// appliedPolicy is one generation of a policy's spec that passed checkPolicy.
type appliedPolicy struct {
	gen  int64
	spec v1alpha1.ImageGCPolicySpec
}

func newPolicySync(c client.Client, b *bus.Bus, rec recorder.EventRecorder, cfg Config, m *metrics) *policySync {
	return &policySync{c: c, status: c.Status(), b: b, rec: rec, log: cfg.Logger.With("worker", "controller", "kind", "imagegcpolicy"),
		m: m, resync: cfg.PolicyResync, kick: make(chan struct{}, 1), applied: map[types.UID]appliedPolicy{}}
}

// Reconcile asks the sync loop for a sync: any change to any policy may change every node's merge.
func (p *policySync) Reconcile(context.Context, ctrl.Request) (ctrl.Result, error) {
	select {
	case p.kick <- struct{}{}:
	default:
	}
	return ctrl.Result{}, nil
}

// Start runs the sync loop on the leader until ctx ends.
func (p *policySync) Start(ctx context.Context) error {
	t := time.NewTicker(p.resync)
	defer t.Stop()
	// Another replica may have led and written the bucket since this one last read it.
	p.written, p.resyncs = nil, 0
	retry := time.Second
	for {
		err := p.sync(ctx)
		if ctx.Err() != nil {
			return nil
		}
		var after <-chan time.Time
		if err != nil {
			p.log.Warn("image GC policy sync failed", "err", err, "retry_in", retry)
			after = time.After(retry)
			retry = min(2*retry, p.resync)
		} else {
			retry = time.Second
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.kick:
		case <-t.C:
			p.resynced()
		case <-after:
		}
	}
}

// resynced counts a periodic resync and drops written every policyReread of them.
func (p *policySync) resynced() {
	if p.resyncs++; p.resyncs >= policyReread {
		p.written, p.resyncs = nil, 0
	}
}

// NeedLeaderElection: only the leader writes the bucket.
func (p *policySync) NeedLeaderElection() bool { return true }

// policyOutcome is what a sync found for one policy.
type policyOutcome struct {
	matched int32
	invalid error
	// applied is the generation in force on the selected nodes: the object's, or while invalid its last
	// valid one; nil: none.
	applied *appliedPolicy
	// conflict is the first refused merge the policy takes part in, on conflictNode; conflictNodes counts
	// the nodes of such merges.
	conflict      *mergeConflict
	conflictNode  string
	conflictNodes int
}

// policyPlan is what one sync decided.
type policyPlan struct {
	want     map[string][]byte // each node key's effective policy
	hold     map[string]bool   // the keys of nodes whose merge checkMerge refuses: left as they are
	outcomes map[string]*policyOutcome
}

func (p *policySync) sync(ctx context.Context) error {
	if p.kv == nil {
		kv, err := p.b.KV(ctx, bus.KVConfig{Bucket: events.GCPolicyBucket, Description: events.GCPolicyBucketDescription})
		if err != nil {
			return err
		}
		p.kv = kv
	}
	if p.reg == nil {
		reg, err := fleet.OpenRegistry(ctx, p.b, fleet.RegistryOptions{})
		if err != nil {
			return err
		}
		p.reg = reg
	}
	if p.written == nil {
		entries, err := p.kv.List(ctx, ">")
		if err != nil {
			return err
		}
		p.written = make(map[string][]byte, len(entries))
		for _, e := range entries {
			p.written[e.Key] = e.Value
		}
	}
	var list v1alpha1.ImageGCPolicyList
	if err := p.c.List(ctx, &list); err != nil {
		return fmt.Errorf("list ImageGCPolicies: %w", err)
	}
	nodes, err := p.reg.Nodes(ctx)
	if err != nil {
		return err
	}

	pl, err := p.plan(list.Items, nodes)
	if err != nil {
		return err
	}
	want := pl.want
	puts := map[string][]byte{}
	for k, v := range want {
		if old, ok := p.written[k]; !ok || string(old) != string(v) {
			puts[k] = v
		}
	}
	var deletes []string
	for k := range p.written {
		if _, ok := want[k]; !ok && !pl.hold[k] {
			deletes = append(deletes, k)
		}
	}
	slices.Sort(deletes)
	if p.m != nil {
		p.m.policyConflicts.Set(float64(len(pl.hold)))
	}
	var writeErr error
	if len(puts) > 0 || len(deletes) > 0 {
		var revs map[string]uint64
		revs, writeErr = p.kv.BatchRevisions(ctx, puts, deletes)
		if writeErr != nil {
			p.written = nil  // read the bucket again before the next sync
			p.announce(revs) // the keys that were written
		} else {
			maps.Copy(p.written, puts)
			for _, k := range deletes {
				delete(p.written, k)
			}
			p.announce(revs)
			p.log.Info("image GC policies delivered", "written", len(puts), "deleted", len(deletes), "nodes", len(want))
		}
	}
	for i := range list.Items {
		o := &list.Items[i]
		if out := pl.outcomes[o.Name]; out != nil {
			if err := p.writeStatus(ctx, o, out, writeErr); err != nil {
				return err
			}
		}
	}
	return writeErr
}

// announce tells each node whose key was written its key's new revision (events.GCPolicyNotice), so its GC
// executor reads the key at once; a notice lost is made up by the node's own periodic read.
func (p *policySync) announce(revs map[string]uint64) {
	for token, rev := range revs {
		if err := p.b.AnnounceRevision(events.GCPolicyNotice(events.NodeFromToken(token)), rev); err != nil {
			p.log.Warn("image GC policy notice not sent; the node reads its key at its next resync", "node", events.NodeFromToken(token), "err", err)
			return
		}
	}
}

// plan computes each node's effective policy from the policies in force: each object's generation if
// checkPolicy accepts it, else its last valid one (lastValid). A node whose merge checkMerge refuses gets
// no value (the node keeps the one it has) and its policies a conflict.
func (p *policySync) plan(items []v1alpha1.ImageGCPolicy, nodes []events.NodeStatus) (policyPlan, error) {
	pl := policyPlan{want: make(map[string][]byte, len(nodes)), hold: map[string]bool{}, outcomes: make(map[string]*policyOutcome, len(items))}
	var inForce []checkedPolicy
	seen := make(map[types.UID]bool, len(items))
	for i := range items {
		o := &items[i]
		if o.DeletionTimestamp != nil {
			continue
		}
		seen[o.UID] = true
		out := &policyOutcome{}
		pl.outcomes[o.Name] = out
		cp, err := checkPolicy(o)
		if err == nil {
			a := appliedPolicy{gen: o.Generation, spec: *o.Spec.DeepCopy()}
			p.applied[o.UID], out.applied = a, &a
			inForce = append(inForce, cp)
			continue
		}
		out.invalid = err
		if cp, a, ok := p.lastValid(o); ok {
			out.applied = &a
			inForce = append(inForce, cp)
		}
	}
	for uid := range p.applied {
		if !seen[uid] {
			delete(p.applied, uid)
		}
	}
	for _, n := range nodes {
		var sel []*v1alpha1.ImageGCPolicy
		for _, cp := range inForce {
			if cp.sel.Matches(labels.Set(n.Labels)) {
				sel = append(sel, cp.obj)
				pl.outcomes[cp.obj.Name].matched++
			}
		}
		eff := effectivePolicy(sel, n.Labels)
		if eff == nil {
			continue
		}
		key := events.NodeToken(n.Node)
		if c := checkMerge(sel); c != nil {
			pl.hold[key] = true
			for _, name := range c.policies {
				out := pl.outcomes[name]
				if out.conflict == nil {
					out.conflict, out.conflictNode = c, n.Node
				}
				out.conflictNodes++
			}
			continue
		}
		raw, err := json.Marshal(eff)
		if err != nil {
			return policyPlan{}, err
		}
		pl.want[key] = raw
	}
	return pl, nil
}

// lastValid is the last generation of o that passed checkPolicy, from applied or, for a leader that did not
// see it, from o's status, whichever is later; checked again, as a stored spec is not trusted blindly.
func (p *policySync) lastValid(o *v1alpha1.ImageGCPolicy) (checkedPolicy, appliedPolicy, bool) {
	a, ok := p.applied[o.UID]
	if st := o.Status; st.AppliedSpec != nil && st.AppliedGeneration > a.gen && st.AppliedGeneration < o.Generation {
		a, ok = appliedPolicy{gen: st.AppliedGeneration, spec: *st.AppliedSpec.DeepCopy()}, true
	}
	if !ok {
		return checkedPolicy{}, appliedPolicy{}, false
	}
	old := o.DeepCopy()
	old.Generation, old.Spec = a.gen, a.spec
	cp, err := checkPolicy(old)
	if err != nil {
		return checkedPolicy{}, appliedPolicy{}, false
	}
	p.applied[o.UID] = a
	return cp, a, true
}

// readyCondition is o's Ready condition for what the sync found.
func readyCondition(o *v1alpha1.ImageGCPolicy, out *policyOutcome, writeErr error) metav1.Condition {
	cond := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonApplied,
		Message: fmt.Sprintf("effective policy written for the %d selected nodes", out.matched), ObservedGeneration: o.Generation}
	switch {
	case out.invalid != nil:
		cond.Status, cond.Reason = metav1.ConditionFalse, v1alpha1.ReasonInvalidSpec
		if out.applied != nil {
			cond.Message = fmt.Sprintf("%v; the last valid generation, %d, stays in force on the %d selected nodes", out.invalid, out.applied.gen, out.matched)
		} else {
			cond.Message = fmt.Sprintf("%v; no generation is in force", out.invalid)
		}
	case out.conflict != nil:
		others := ""
		if n := out.conflictNodes - 1; n > 0 {
			others = fmt.Sprintf(" and %d other nodes", n)
		}
		cond.Status, cond.Reason = metav1.ConditionFalse, v1alpha1.ReasonConflictingPolicies
		cond.Message = fmt.Sprintf("%s: merged with the other policies of node %s%s, %v; the node would refuse it, so it keeps the policy it has",
			out.conflict.fields, out.conflictNode, others, out.conflict.err)
	case writeErr != nil:
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, v1alpha1.ReasonWriteFailed, writeErr.Error()
	}
	return cond
}

// writeStatus writes o's status when it changed, and posts an Event when its Ready reason or generation did.
func (p *policySync) writeStatus(ctx context.Context, o *v1alpha1.ImageGCPolicy, out *policyOutcome, writeErr error) error {
	st := *o.Status.DeepCopy()
	st.ObservedGeneration, st.MatchedNodes = o.Generation, out.matched
	if a := out.applied; a != nil {
		st.AppliedGeneration, st.AppliedSpec = a.gen, a.spec.DeepCopy()
	}
	cond := readyCondition(o, out, writeErr)
	eventType := "Normal"
	if cond.Status != metav1.ConditionTrue {
		eventType = "Warning"
	}
	prev := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionReady)
	meta.SetStatusCondition(&st.Conditions, cond)
	if equality.Semantic.DeepEqual(st, o.Status) {
		return nil
	}
	// A JSON patch that replaces the whole status: a merge patch would merge appliedSpec into the stored
	// one and keep the fields a later generation dropped. The test keeps it to this object, not one of the
	// same name made since the list.
	patch, err := json.Marshal([]map[string]any{
		{"op": "test", "path": "/metadata/uid", "value": o.UID},
		{"op": "add", "path": "/status", "value": st},
	})
	if err != nil {
		return err
	}
	target := &v1alpha1.ImageGCPolicy{}
	target.SetName(o.Name)
	if err := p.status.Patch(ctx, target, client.RawPatch(types.JSONPatchType, patch)); err != nil {
		return fmt.Errorf("patch status of ImageGCPolicy %s: %w", o.Name, err)
	}
	if prev == nil || prev.Reason != cond.Reason || prev.ObservedGeneration != cond.ObservedGeneration {
		p.rec.Eventf(o, nil, eventType, cond.Reason, cond.Reason, "generation %d: %s", o.Generation, cond.Message)
	}
	return nil
}

// copiesRunnable serves the fleet's keepCopies arbiter on every replica (its grants are compare-and-set
// writes, so replicas need no leader).
type copiesRunnable struct{ a *fleet.CopiesArbiter }

func (r copiesRunnable) Start(ctx context.Context) error { return r.a.Run(ctx) }

func (copiesRunnable) NeedLeaderElection() bool { return false }
