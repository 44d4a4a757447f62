package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

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
type policySync struct {
	c      client.Client
	status client.SubResourceWriter
	b      *bus.Bus
	rec    recorder.EventRecorder
	log    *slog.Logger
	resync time.Duration
	kick   chan struct{}

	// Only the sync loop touches these.
	kv      *bus.KV
	reg     *fleet.Registry
	written map[string][]byte // the bucket's values, as last read or written; nil: read it again
}

func newPolicySync(c client.Client, b *bus.Bus, rec recorder.EventRecorder, cfg Config) *policySync {
	return &policySync{c: c, status: c.Status(), b: b, rec: rec, log: cfg.Logger.With("worker", "controller", "kind", "imagegcpolicy"),
		resync: cfg.PolicyResync, kick: make(chan struct{}, 1)}
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
		case <-after:
		}
	}
}

// NeedLeaderElection: only the leader writes the bucket.
func (p *policySync) NeedLeaderElection() bool { return true }

// policyOutcome is what a sync found for one policy.
type policyOutcome struct {
	matched int32
	invalid error
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

	outcomes := make(map[string]*policyOutcome, len(list.Items))
	var valid []checkedPolicy
	for i := range list.Items {
		o := &list.Items[i]
		if o.DeletionTimestamp != nil {
			continue
		}
		out := &policyOutcome{}
		outcomes[o.Name] = out
		cp, err := checkPolicy(o)
		if err != nil {
			out.invalid = err
			continue
		}
		valid = append(valid, cp)
	}
	want := make(map[string][]byte, len(nodes))
	for _, n := range nodes {
		var sel []*v1alpha1.ImageGCPolicy
		for _, cp := range valid {
			if cp.sel.Matches(labels.Set(n.Labels)) {
				sel = append(sel, cp.obj)
				outcomes[cp.obj.Name].matched++
			}
		}
		eff := effectivePolicy(sel, n.Labels)
		if eff == nil {
			continue
		}
		raw, err := json.Marshal(eff)
		if err != nil {
			return err
		}
		want[events.NodeToken(n.Node)] = raw
	}
	puts := map[string][]byte{}
	for k, v := range want {
		if old, ok := p.written[k]; !ok || string(old) != string(v) {
			puts[k] = v
		}
	}
	var deletes []string
	for k := range p.written {
		if _, ok := want[k]; !ok {
			deletes = append(deletes, k)
		}
	}
	slices.Sort(deletes)
	var writeErr error
	if len(puts) > 0 || len(deletes) > 0 {
		var revs map[string]uint64
		if revs, writeErr = p.kv.BatchRevisions(ctx, puts, deletes); writeErr != nil {
			p.written = nil // read the bucket again before the next sync
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
		if out := outcomes[o.Name]; out != nil {
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

// writeStatus writes o's status when it changed, and posts an Event when its Ready reason or generation did.
func (p *policySync) writeStatus(ctx context.Context, o *v1alpha1.ImageGCPolicy, out *policyOutcome, writeErr error) error {
	st := *o.Status.DeepCopy()
	st.ObservedGeneration, st.MatchedNodes = o.Generation, out.matched
	cond := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonApplied,
		Message: fmt.Sprintf("effective policy written for the %d selected nodes", out.matched), ObservedGeneration: o.Generation}
	eventType := "Normal"
	switch {
	case out.invalid != nil:
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, v1alpha1.ReasonInvalidSpec, out.invalid.Error()
		st.MatchedNodes = 0
		eventType = "Warning"
	case writeErr != nil:
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, v1alpha1.ReasonWriteFailed, writeErr.Error()
		eventType = "Warning"
	}
	prev := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionReady)
	meta.SetStatusCondition(&st.Conditions, cond)
	if st.ObservedGeneration == o.Status.ObservedGeneration && st.MatchedNodes == o.Status.MatchedNodes && prev != nil &&
		prev.Status == cond.Status && prev.Reason == cond.Reason && prev.Message == cond.Message && prev.ObservedGeneration == cond.ObservedGeneration {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"uid": o.UID}, "status": st})
	if err != nil {
		return err
	}
	target := &v1alpha1.ImageGCPolicy{}
	target.SetName(o.Name)
	if err := p.status.Patch(ctx, target, client.RawPatch(types.MergePatchType, patch)); err != nil {
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
