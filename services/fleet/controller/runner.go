package controller

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// maxFailedNodes is how many failed nodes a status lists (the rest: imagefleet fleet follow ID).
const maxFailedNodes = 20

// runner runs one object's rollout: it plans it (or finds it recorded on the bus), runs it with the
// fleet's rollout engine, holds each wave at its start while the object is paused, and restarts the engine
// at a wave's start when the in-flight limit changed (nothing is in flight then, so the restart resumes
// without failing a node). The status it keeps is written by its flusher.
type runner struct {
	r    *reconciler
	name string
	uid  types.UID
	obj  client.Object // the object as first seen: the Events' subject and the status patch's target

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	spec   v1alpha1.RolloutSpec // the latest seen
	gen    int64
	wake   chan struct{} // closed and made anew at each update
	status v1alpha1.RolloutStatus
	// outcomes holds each ended node's outcome, so that a resumed rollout (which reports its earlier
	// outcomes again) counts each node once.
	outcomes map[string]outcome
	sums     sums
	waveSize int
	waveDone int
	dirty    bool
	flushNow chan struct{}
	flushMu  sync.Mutex // one status write at a time (flush)
	// firing and window are a scheduled ImageGC's run's (scheduled.go); zero for an unscheduled object.
	firing     time.Time
	window     time.Duration
	windowWave int // the wave the window ended before
}

type outcome struct {
	ok     bool
	counts events.GCCounts
}

func newRunner(base context.Context, r *reconciler, obj client.Object) *runner {
	ctx, cancel := context.WithCancel(base)
	return &runner{r: r, name: obj.GetName(), uid: obj.GetUID(), obj: obj.DeepCopyObject().(client.Object),
		ctx: ctx, cancel: cancel, done: make(chan struct{}), wake: make(chan struct{}),
		status: *r.kind.status(obj).DeepCopy(), outcomes: map[string]outcome{}, flushNow: make(chan struct{}, 1)}
}

// stop ends the runner and waits for it. The rollout stays on the bus: a later runner resumes it.
func (run *runner) stop() {
	run.cancel()
	<-run.done
}

// update passes the object's current spec: pause and in-flight limit take effect at the next wave's start.
func (run *runner) update(obj client.Object) {
	run.mu.Lock()
	defer run.mu.Unlock()
	run.spec = *run.r.kind.spec(obj)
	if g := obj.GetGeneration(); g != run.gen {
		run.gen = g
		run.status.ObservedGeneration = g
		run.markLocked(false)
	}
	close(run.wake)
	run.wake = make(chan struct{})
}

func (run *runner) current() (v1alpha1.RolloutSpec, <-chan struct{}) {
	run.mu.Lock()
	defer run.mu.Unlock()
	return run.spec, run.wake
}

// run is the runner's life: start, run the rollout (again after an error or a restart), finish.
func (run *runner) run() {
	defer close(run.done)
	running := run.r.m.running.WithLabelValues(run.r.kind.name)
	running.Inc()
	defer running.Dec()
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		run.flusher()
	}()
	defer func() {
		run.cancel()
		<-flushed
	}()
	run.mu.Lock()
	if run.status.RolloutID == "" {
		run.status.RolloutID = run.r.kind.rollout + "-" + string(run.uid)
	}
	id := run.status.RolloutID
	first := run.status.StartTime == nil
	if first {
		now := metav1.Now()
		run.status.StartTime = &now
	}
	run.status.Phase = v1alpha1.PhaseRunning
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionTrue,
		Reason: "RolloutStarted", Message: "rollout " + id + " started", ObservedGeneration: run.gen})
	run.mu.Unlock()
	if err := run.flushSync(); err != nil {
		return
	}
	if first {
		run.event(corev1.EventTypeNormal, "Started", "Started rollout %s", id)
	}
	wait := time.Second
	for {
		res, restart, err := run.once(id)
		if run.ctx.Err() != nil {
			return
		}
		if restart {
			continue
		}
		if err != nil {
			var p permanent
			if errors.As(err, &p) {
				run.fail("InvalidSpec", err.Error())
				return
			}
			run.r.log.Warn("rollout failed; resuming it", "name", run.name, "rollout", id, "err", err, "after", wait)
			run.mu.Lock()
			meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionTrue,
				Reason: "RolloutError", Message: err.Error(), ObservedGeneration: run.gen})
			run.markLocked(true)
			run.mu.Unlock()
			run.event(corev1.EventTypeWarning, "RolloutError", "Rollout %s: %v; resuming in %s", id, err, wait)
			select {
			case <-time.After(wait):
			case <-run.ctx.Done():
				return
			}
			wait = min(2*wait, time.Minute)
			continue
		}
		run.finish(res)
		return
	}
}

// once plans (or finds) the rollout and runs it once. restart is true when it stopped at a wave's start
// to take a new in-flight limit.
func (run *runner) once(id string) (res events.RolloutResult, restart bool, err error) {
	ctx, b, k := run.ctx, run.r.b, run.r.kind
	spec, _ := run.current()
	budget, err := fleet.ParseFailureBudget(spec.FailureBudget.String())
	if err != nil {
		return res, false, permanent{fmt.Errorf("failureBudget: %w", err)}
	}
	selector := ""
	if spec.Nodes.Selector != nil {
		sel, err := metav1.LabelSelectorAsSelector(spec.Nodes.Selector)
		if err != nil {
			return res, false, permanent{fmt.Errorf("nodes.selector: %w", err)}
		}
		selector = sel.String()
	}
	var timeout time.Duration // 0: the engine's default, the schema's
	if spec.NodeTimeout != nil {
		timeout = spec.NodeTimeout.Duration
	}
	cfg := fleet.RolloutConfig{ID: id, Kind: k.rollout, Selector: selector, InitialBatch: int(spec.Waves.InitialBatch),
		NodeTimeout: timeout, FailureBudget: budget, MaxInFlight: int(spec.Waves.MaxInFlight),
		Replicas: run.r.cfg.StreamReplicas, Logger: run.r.log}
	if err := fleet.EnsureRolloutStream(ctx, b, cfg.Replicas); err != nil {
		return res, false, err
	}
	started, err := fleet.LoadRolloutStarted(ctx, b, id)
	if err != nil {
		return res, false, err
	}
	var domains map[string]string
	switch {
	case started != nil: // resumed: the engine keeps the recorded plan
		cfg.Nodes, cfg.Skipped = started.Nodes, started.Skipped
	case len(spec.Nodes.Names) > 0:
		cfg.Nodes = spec.Nodes.Names
		if _, keep := keepsNewNodes(run.obj); keep { // the named nodes not Ready yet are warmed as they join
			if cfg.Nodes, cfg.Skipped, domains, err = readyNames(ctx, b, spec.Nodes.Names); err != nil {
				return res, false, err
			}
		}
	default:
		p, err := fleet.Plan(ctx, b, selector, spec.Nodes.IncludeLost, time.Now)
		if err != nil {
			return res, false, err
		}
		cfg.Nodes, cfg.Skipped, domains = p.Nodes, p.Skipped, p.Domains
	}
	act, stop, err := k.prepare(ctx, b, run.obj, &cfg, domains)
	if err != nil {
		return res, false, err
	}
	defer stop()

	run.mu.Lock()
	run.status.Desired, run.status.Skipped = int32(len(cfg.Nodes)), int32(len(cfg.Skipped))
	run.status.Waves = nil
	initial := cfg.InitialBatch
	if started != nil {
		initial = started.InitialBatch
	}
	for _, n := range fleet.PlanBatches(len(cfg.Nodes), max(initial, 1)) {
		run.status.Waves = append(run.status.Waves, int32(n))
	}
	run.progressLocked()
	run.mu.Unlock()

	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	cfg.Results = func(nr events.RolloutNodeResult) {
		if runCtx.Err() == nil { // after a restart's cancel, the wave's nodes end unclaimed: not outcomes
			run.record(nr)
		}
	}
	// A scheduled run's window ends at a wave's start (nothing is in flight then): StopBefore ends the
	// rollout there, and its finished record says WindowEnded.
	windowEnded := false
	cfg.Progress = func(p fleet.Progress) {
		if p.Batch != nil && runCtx.Err() == nil {
			if run.windowDone() {
				windowEnded, run.windowWave = true, p.Batch.Index
				return
			}
			if run.waveStart(runCtx, *p.Batch, cfg.MaxInFlight) {
				restart = true
				cancelRun()
			} else if run.windowDone() { // paused past the window
				windowEnded, run.windowWave = true, p.Batch.Index
			}
		}
	}
	cfg.StopBefore = func(events.RolloutBatch) string {
		if windowEnded {
			return stopWindowEnded
		}
		return ""
	}
	ro, err := fleet.NewRollout(cfg, b, act)
	if err != nil {
		return res, false, permanent{err}
	}
	res, err = ro.Run(runCtx)
	if restart && ctx.Err() == nil {
		return res, true, nil
	}
	return res, false, err
}

// waveStart records a wave's start, holds it while the object is paused, and reports whether the
// in-flight limit changed (the engine is then restarted: nothing is in flight at a wave's start).
func (run *runner) waveStart(ctx context.Context, b events.RolloutBatch, maxInFlight int) (restart bool) {
	run.mu.Lock()
	run.status.CurrentWave = int32(b.Index)
	run.waveSize, run.waveDone = b.Size, 0
	for _, n := range b.Nodes {
		if _, ok := run.outcomes[n]; ok {
			run.waveDone++
		}
	}
	run.status.Active = int32(run.waveSize - run.waveDone)
	run.markLocked(true)
	run.mu.Unlock()
	run.event(corev1.EventTypeNormal, "WaveStarted", "Wave %d: %d nodes", b.Index, b.Size)
	paused := false
	for {
		spec, wake := run.current()
		if !spec.Paused {
			if paused {
				run.setPaused(false)
			}
			if int(spec.Waves.MaxInFlight) != maxInFlight && spec.Waves.MaxInFlight > 0 {
				run.event(corev1.EventTypeNormal, "MaxInFlightChanged", "At most %d nodes at once from wave %d", spec.Waves.MaxInFlight, b.Index)
				return true
			}
			return false
		}
		if !paused {
			paused = true
			run.setPaused(true)
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return false
		}
	}
}

func (run *runner) setPaused(p bool) {
	run.mu.Lock()
	c := metav1.Condition{Type: v1alpha1.ConditionPaused, Status: metav1.ConditionFalse, Reason: "Resumed",
		Message: "spec.paused is false", ObservedGeneration: run.gen}
	run.status.Phase = v1alpha1.PhaseRunning
	if p {
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, "PausedBySpec", fmt.Sprintf("wave %d waits: spec.paused is true", run.status.CurrentWave)
		run.status.Phase = v1alpha1.PhasePaused
		run.status.Active = 0
	}
	meta.SetStatusCondition(&run.status.Conditions, c)
	run.markLocked(true)
	wave := run.status.CurrentWave
	run.mu.Unlock()
	if p {
		run.event(corev1.EventTypeNormal, "Paused", "Paused before wave %d", wave)
	} else {
		run.event(corev1.EventTypeNormal, "Resumed", "Resumed at wave %d", wave)
	}
}

// record counts one node's outcome.
func (run *runner) record(nr events.RolloutNodeResult) {
	run.mu.Lock()
	prev, seen := run.outcomes[nr.Node]
	if seen {
		run.sums.add(prev, -1)
	}
	o := outcome{ok: nr.OK, counts: nr.Counts()}
	run.outcomes[nr.Node] = o
	run.sums.add(o, 1)
	if !seen && nr.Batch == int(run.status.CurrentWave) {
		run.waveDone++
		run.status.Active = int32(max(run.waveSize-run.waveDone, 0))
	}
	run.progressLocked()
	now := false
	if !nr.OK && len(run.status.FailedNodes) < maxFailedNodes && !hasFailure(run.status.FailedNodes, nr.Node) {
		run.status.FailedNodes = append(run.status.FailedNodes, v1alpha1.NodeFailure{Node: nr.Node, Reason: nr.Error})
		now = true
	}
	run.markLocked(now)
	run.mu.Unlock()
	if now {
		run.event(corev1.EventTypeWarning, "NodeFailed", "Node %s: %s", nr.Node, nr.Error)
	}
}

func hasFailure(fs []v1alpha1.NodeFailure, node string) bool {
	for _, f := range fs {
		if f.Node == node {
			return true
		}
	}
	return false
}

// sums are the outcomes' counters, kept as outcomes come and are replaced (a resumed rollout reports its
// earlier outcomes again): a node's end costs O(1), not a pass over the fleet.
type sums struct {
	ok, failed     int32
	bytes, removed int64
}

func (s *sums) add(o outcome, sign int) {
	if o.ok {
		s.ok += int32(sign)
	} else {
		s.failed += int32(sign)
	}
	s.bytes += int64(sign) * o.counts.Bytes
	s.removed += int64(sign) * int64(o.counts.Removed)
}

// progressLocked puts the counters into the status.
func (run *runner) progressLocked() {
	s := run.sums
	run.status.Succeeded, run.status.Failed = s.ok, s.failed
	if run.r.kind.rollout == events.RolloutGC {
		run.status.BytesFreed, run.status.ImagesRemoved = s.bytes, s.removed
	}
	run.status.Progress = fmt.Sprintf("%d/%d", s.ok+s.failed, run.status.Desired)
}

// finish writes the rollout's end: Complete when every wave ran (failures within the budget included),
// Failed when the budget stopped it.
func (run *runner) finish(res events.RolloutResult) {
	if !run.firing.IsZero() {
		run.endScheduled(res, "", "")
		return
	}
	run.mu.Lock()
	now := metav1.Now()
	run.status.CompletionTime, run.status.Active = &now, 0
	run.progressLocked()
	done := run.status.Succeeded + run.status.Failed
	var cond metav1.Condition
	var evType, reason, msg string
	if res.StopReason == events.RolloutMaxFailuresExceeded {
		run.status.Phase = v1alpha1.PhaseFailed
		reason = "FailureBudgetExceeded"
		msg = fmt.Sprintf("%d of %d nodes failed, over the failure budget %s (%d); %d not started", run.status.Failed, run.status.Desired,
			res.MaxFailures, res.FailureBudget, int(run.status.Desired)-int(done))
		cond = metav1.Condition{Type: v1alpha1.ConditionFailed, Status: metav1.ConditionTrue, Reason: reason, Message: msg}
		evType = corev1.EventTypeWarning
	} else {
		run.status.Phase = v1alpha1.PhaseComplete
		reason = "Completed"
		if run.status.Failed > 0 {
			reason = "CompletedWithFailures"
		}
		msg = fmt.Sprintf("%d of %d nodes succeeded, %d failed", run.status.Succeeded, run.status.Desired, run.status.Failed)
		cond = metav1.Condition{Type: v1alpha1.ConditionComplete, Status: metav1.ConditionTrue, Reason: reason, Message: msg}
		evType = corev1.EventTypeNormal
	}
	cond.ObservedGeneration = run.gen
	meta.SetStatusCondition(&run.status.Conditions, cond)
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionFalse,
		Reason: reason, Message: msg, ObservedGeneration: run.gen})
	run.markLocked(false)
	run.mu.Unlock()
	if run.flushSync() == nil {
		run.event(evType, reason, "Rollout %s: %s", run.status.RolloutID, msg)
	}
}

// fail ends the object as Failed without a rollout (a spec the engine refuses).
func (run *runner) fail(reason, msg string) {
	if !run.firing.IsZero() {
		run.endScheduled(events.RolloutResult{}, reason, msg)
		return
	}
	run.mu.Lock()
	now := metav1.Now()
	run.status.CompletionTime, run.status.Active, run.status.Phase = &now, 0, v1alpha1.PhaseFailed
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionFailed, Status: metav1.ConditionTrue,
		Reason: reason, Message: msg, ObservedGeneration: run.gen})
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionFalse,
		Reason: reason, Message: msg, ObservedGeneration: run.gen})
	run.markLocked(false)
	run.mu.Unlock()
	if run.flushSync() == nil {
		run.event(corev1.EventTypeWarning, reason, "%s", msg)
	}
}

func (run *runner) event(eventType, reason, note string, args ...any) {
	run.r.rec.Eventf(run.obj, nil, eventType, reason, reason, note, args...)
}
