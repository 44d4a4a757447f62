package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
)

// This file runs a scheduled ImageGC (spec.schedule): like a CronJob, each firing is one run, a fleet
// rollout of its own (runID), run by a runner as an unscheduled object's one rollout is. Between runs the
// reconciler owns the status; during a run, the runner does. The reconciler wakes at the next firing with a
// timer of Config.Clock, which enqueues the object (wakeSource).

// stopWindowEnded is a run's StopReason when its window ended before a wave.
const stopWindowEnded = "WindowEnded"

// scheduled is what the reconciler keeps of one scheduled object.
type scheduled struct {
	uid types.UID
	// run is the latest run's runner (running, or done).
	run *runner
	// idle is the status the reconciler last wrote between runs (nil: the latest run's end, or none).
	idle *v1alpha1.RolloutStatus
	// announced is the latest firing whose skip was announced with an Event.
	announced time.Time
	timer     clock.Timer
}

// scheduledGC returns obj as an ImageGC with a schedule.
func scheduledGC(obj client.Object) (*v1alpha1.ImageGC, bool) {
	o, ok := obj.(*v1alpha1.ImageGC)
	return o, ok && o.Spec.Schedule != ""
}

// wakeSource is the channel the schedule's timers enqueue objects by.
func (r *reconciler) wakeSource() source.Source {
	return source.Channel(r.wakeups(), &handler.EnqueueRequestForObject{})
}

func (r *reconciler) wakeups() chan event.GenericEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.wake == nil {
		r.wake = make(chan event.GenericEvent, 64)
	}
	return r.wake
}

// poke enqueues the object name.
func (r *reconciler) poke(name string) {
	o := r.kind.newObject()
	o.SetName(name)
	select {
	case r.wakeups() <- event.GenericEvent{Object: o}:
	case <-r.base.Done():
	}
}

func (r *reconciler) clock() clock.WithTickerAndDelayedExecution {
	if r.cfg.Clock == nil {
		return clock.RealClock{}
	}
	return r.cfg.Clock
}

// now is the clock's time to the second, as the API server keeps it.
func (r *reconciler) now() metav1.Time {
	return metav1.NewTime(r.clock().Now().Truncate(time.Second))
}

// schedState returns the state of o, made anew for a new UID.
func (r *reconciler) schedState(o *v1alpha1.ImageGC) *scheduled {
	r.mu.Lock()
	if r.sched == nil {
		r.sched = map[string]*scheduled{}
	}
	s := r.sched[o.Name]
	if s != nil && s.uid == o.UID {
		r.mu.Unlock()
		return s
	}
	old := s
	s = &scheduled{uid: o.UID}
	r.sched[o.Name] = s
	if old != nil && old.run != nil && r.runners[o.Name] == old.run {
		delete(r.runners, o.Name)
	}
	r.mu.Unlock()
	if old != nil { // deleted and made again under the same name
		if old.timer != nil {
			old.timer.Stop()
		}
		if old.run != nil {
			old.run.stop()
		}
	}
	return s
}

// forgetSchedule drops the state of name (deleted): its timer stops.
func (r *reconciler) forgetSchedule(name string) {
	r.mu.Lock()
	s := r.sched[name]
	delete(r.sched, name)
	r.mu.Unlock()
	if s != nil && s.timer != nil {
		s.timer.Stop()
	}
}

// reconcileScheduled starts the run of a due firing, skips the firings that cannot run (announced with
// ScheduleSkipped), resumes a run the controller was stopped in, and writes the schedule's status. Calls
// for one object come one at a time (controller-runtime's queue), so state needs no lock of its own.
func (r *reconciler) reconcileScheduled(ctx context.Context, o *v1alpha1.ImageGC) (ctrl.Result, error) {
	st := r.schedState(o)
	running := st.run != nil && !st.run.isDone()
	var base *v1alpha1.RolloutStatus
	switch {
	case running:
		st.run.update(o)
	case st.idle != nil:
		base = st.idle.DeepCopy()
	case st.run != nil:
		base = st.run.snapshot()
	default:
		base = o.Status.DeepCopy()
	}
	if !running && base.LastScheduleTime != nil && base.CompletionTime == nil && base.RolloutID != "" {
		// A run the controller (or the last leader) stopped in: resume its rollout.
		var window time.Duration
		if o.Spec.Window != nil {
			window = o.Spec.Window.Duration
		}
		if err := r.startRun(ctx, o, st, *base, base.LastScheduleTime.Time, window, nil); err != nil {
			return ctrl.Result{}, err
		}
		running, base = true, nil
	}

	now := r.clock().Now()
	sch, err := parseSchedule(o.Spec, now)
	if err != nil {
		if st.timer != nil {
			st.timer.Stop()
		}
		se := err.(*scheduleError)
		c := metav1.Condition{Type: v1alpha1.ConditionScheduled, Status: metav1.ConditionFalse, Reason: se.reason, Message: se.msg,
			ObservedGeneration: o.Generation}
		if running {
			if st.run.setSchedule(c, nil) {
				r.rec.Eventf(o, nil, corev1.EventTypeWarning, se.reason, se.reason, "%s", se.msg)
			}
			return ctrl.Result{}, nil
		}
		old := meta.FindStatusCondition(base.Conditions, v1alpha1.ConditionScheduled)
		base.NextScheduleTime = nil
		base.ObservedGeneration = o.Generation
		if base.Phase == "" {
			base.Phase = v1alpha1.PhaseScheduled
		}
		meta.SetStatusCondition(&base.Conditions, c)
		if err := r.writeIdle(ctx, o, st, base); err != nil {
			return ctrl.Result{}, err
		}
		if old == nil || old.Reason != se.reason || old.Message != se.msg {
			r.rec.Eventf(o, nil, corev1.EventTypeWarning, se.reason, se.reason, "%s", se.msg)
		}
		return ctrl.Result{}, nil
	}

	// The firings after the latest run's, or after the object's creation; each skipped one counts once.
	anchor := o.CreationTimestamp.Time
	last := o.Status.LastScheduleTime
	if !running {
		last = base.LastScheduleTime
	} else if t := st.run.firing; !t.IsZero() {
		last = &metav1.Time{Time: t}
	}
	if last != nil && last.After(anchor) {
		anchor = last.Time
	}
	if st.announced.After(anchor) {
		anchor = st.announced
	}
	d := sch.decide(anchor, now, running || o.Spec.Paused)
	if d.Skipped > 0 {
		why := fmt.Sprintf("not started within %s of its time", sch.deadline())
		switch {
		case running:
			why = "run " + st.run.id() + " was still going"
		case o.Spec.Paused:
			why = "spec.paused is true"
		case !d.Fire.IsZero():
			why = "a later firing is due"
		}
		n := fmt.Sprint(d.Skipped)
		if d.Capped {
			n = "more than " + n
		}
		r.rec.Eventf(o, nil, corev1.EventTypeWarning, "ScheduleSkipped", "ScheduleSkipped", "Skipped %s firing(s), the latest at %s: %s",
			n, d.LastSkipped.In(sch.loc).Format(time.RFC3339), why)
		st.announced = d.LastSkipped
	}
	next := metav1.NewTime(d.Next)
	ok := metav1.Condition{Type: v1alpha1.ConditionScheduled, Status: metav1.ConditionTrue, Reason: "Scheduled",
		Message: fmt.Sprintf("next run at %s", d.Next.In(sch.loc).Format(time.RFC3339)), ObservedGeneration: o.Generation}
	switch {
	case running:
		st.run.setSchedule(ok, &next)
	case !d.Fire.IsZero():
		run := *base
		run.NextScheduleTime = &next
		meta.SetStatusCondition(&run.Conditions, ok)
		fire := d.Fire
		started := func(id string) {
			r.rec.Eventf(o, nil, corev1.EventTypeNormal, "RunStarted", "RunStarted", "Started run %s for the firing at %s", id,
				fire.In(sch.loc).Format(time.RFC3339))
		}
		if err := r.startRun(ctx, o, st, run, d.Fire, sch.window, started); err != nil {
			return ctrl.Result{}, err // the firing is tried again until its deadline
		}
	default:
		base.NextScheduleTime = &next
		base.ObservedGeneration = o.Generation
		if base.Phase == "" || base.Phase == v1alpha1.PhaseRunning || base.Phase == v1alpha1.PhasePaused {
			base.Phase = v1alpha1.PhaseScheduled
		}
		meta.SetStatusCondition(&base.Conditions, ok)
		if err := r.writeIdle(ctx, o, st, base); err != nil {
			return ctrl.Result{}, err
		}
	}
	r.wakeAt(o.Name, st, d.Wake(sch))
	return ctrl.Result{}, nil
}

// wakeAt enqueues name again when the clock reaches at, replacing the timer set before. The delay is read
// from the clock as the timer is set, not at the reconcile's start, so a slow status write in between does
// not make the timer late; a clock that moves on by a second or more while the timer is set (a stalled
// process, a test's fake clock stepped) sets it again. A time already reached enqueues at once: a fake
// clock's zero-delay timer would wait for its next step.
func (r *reconciler) wakeAt(name string, st *scheduled, at time.Time) {
	if st.timer != nil {
		st.timer.Stop()
		st.timer = nil
	}
	clk := r.clock()
	for {
		now := clk.Now()
		if !at.After(now) {
			go r.poke(name)
			return
		}
		st.timer = clk.AfterFunc(at.Sub(now), func() { r.poke(name) })
		if clk.Since(now) < time.Second {
			return
		}
		st.timer.Stop()
	}
}

// startRun starts the runner of the firing at fired with status (a new run's or the resumed one's). A
// new run's status is written first: its lastScheduleTime, before any node is acted on. started, when not
// nil, is called with the run's id before the runner starts, so what it records (the RunStarted Event)
// comes before anything the run records.
func (r *reconciler) startRun(ctx context.Context, o *v1alpha1.ImageGC, st *scheduled, status v1alpha1.RolloutStatus, fired time.Time, window time.Duration,
	started func(id string)) error {
	if status.LastScheduleTime == nil || !status.LastScheduleTime.Time.Equal(fired) || status.CompletionTime != nil {
		// A new run: the counters describe it alone.
		now := r.now()
		status = v1alpha1.RolloutStatus{
			ObservedGeneration: o.Generation, Phase: v1alpha1.PhaseRunning, Conditions: status.Conditions,
			RolloutID: runID(string(o.UID), fired), StartTime: &now, LastScheduleTime: &metav1.Time{Time: fired},
			NextScheduleTime: status.NextScheduleTime,
		}
		if err := r.writeWhole(ctx, o, &status); err != nil {
			return err
		}
	}
	run := newRunner(r.base, r, o)
	run.status = status
	run.firing, run.window = fired, window
	run.update(o)
	st.run, st.idle = run, nil
	r.mu.Lock()
	r.runners[o.Name] = run // stopped with the others when the controller stops, or when the object goes
	r.mu.Unlock()
	if started != nil {
		started(status.RolloutID)
	}
	go func() {
		run.run()
		r.poke(o.Name)
	}()
	return nil
}

// writeIdle writes the status between runs when it changed.
func (r *reconciler) writeIdle(ctx context.Context, o *v1alpha1.ImageGC, st *scheduled, status *v1alpha1.RolloutStatus) error {
	if equality.Semantic.DeepEqual(*status, o.Status) {
		st.idle = status
		return nil
	}
	if err := r.writeWhole(ctx, o, status); err != nil {
		return err
	}
	st.idle = status
	return nil
}

// writeWhole writes status as it is: a merge patch conditioned on the UID, as the runner's, that also
// clears every field status leaves empty (a new run's counters start afresh; the runner's patches only
// ever set fields).
func (r *reconciler) writeWhole(ctx context.Context, o *v1alpha1.ImageGC, status *v1alpha1.RolloutStatus) error {
	raw, err := json.Marshal(status)
	if err != nil {
		return err
	}
	var fields map[string]any
	if err := json.Unmarshal(raw, &fields); err != nil {
		return err
	}
	for _, name := range statusFields() {
		if _, ok := fields[name]; !ok {
			fields[name] = nil
		}
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"uid": o.UID}, "status": fields})
	if err != nil {
		return err
	}
	target := &v1alpha1.ImageGC{}
	target.SetName(o.Name)
	if err := r.status.Patch(ctx, target, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return fmt.Errorf("patch status of %s: %w", o.Name, err)
	}
	r.m.statusWrites.WithLabelValues(r.kind.name).Inc()
	return nil
}

// statusFields are the JSON names of RolloutStatus's fields.
func statusFields() []string {
	t := reflect.TypeFor[v1alpha1.RolloutStatus]()
	names := make([]string, 0, t.NumField())
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
			names = append(names, name)
		}
	}
	return names
}

func (run *runner) isDone() bool {
	select {
	case <-run.done:
		return true
	default:
		return false
	}
}

func (run *runner) snapshot() *v1alpha1.RolloutStatus {
	run.mu.Lock()
	defer run.mu.Unlock()
	return run.status.DeepCopy()
}

func (run *runner) id() string {
	run.mu.Lock()
	defer run.mu.Unlock()
	return run.status.RolloutID
}

// setSchedule puts the schedule's condition and next time into a running run's status; it reports whether
// the condition changed.
func (run *runner) setSchedule(c metav1.Condition, next *metav1.Time) bool {
	run.mu.Lock()
	defer run.mu.Unlock()
	old := meta.FindStatusCondition(run.status.Conditions, c.Type)
	changed := old == nil || old.Status != c.Status || old.Reason != c.Reason || old.Message != c.Message
	if !changed && equality.Semantic.DeepEqual(next, run.status.NextScheduleTime) {
		return false
	}
	meta.SetStatusCondition(&run.status.Conditions, c)
	run.status.NextScheduleTime = next
	run.markLocked(false)
	return changed
}

// windowDone reports whether the run's window has ended: no wave starts any more.
func (run *runner) windowDone() bool {
	return !run.firing.IsZero() && windowEnded(run.firing, run.window, run.r.clock().Now())
}

// endScheduled writes the end of a scheduled run: LastRunComplete True (every wave ran) or False (the
// failure budget, the window, a refused spec), Progressing False, the phase back to Scheduled.
func (run *runner) endScheduled(res events.RolloutResult, reason, msg string) {
	run.mu.Lock()
	now := run.r.now()
	run.status.CompletionTime, run.status.Active = &now, 0
	run.progressLocked()
	done := run.status.Succeeded + run.status.Failed
	notStarted := int(run.status.Desired) - int(done)
	status, evType := metav1.ConditionFalse, corev1.EventTypeWarning
	switch {
	case reason != "": // refused before a node was acted on
	case res.StopReason == stopWindowEnded:
		reason = stopWindowEnded
		msg = fmt.Sprintf("the window %s ended before wave %d: %d of %d nodes succeeded, %d failed, %d not started", run.window,
			run.windowWave, run.status.Succeeded, run.status.Desired, run.status.Failed, notStarted)
	case res.StopReason == events.RolloutMaxFailuresExceeded:
		reason = "FailureBudgetExceeded"
		msg = fmt.Sprintf("%d of %d nodes failed, over the failure budget %s (%d); %d not started", run.status.Failed, run.status.Desired,
			res.MaxFailures, res.FailureBudget, notStarted)
	default:
		status, evType, reason = metav1.ConditionTrue, corev1.EventTypeNormal, "Completed"
		if run.status.Failed > 0 {
			reason = "CompletedWithFailures"
		}
		msg = fmt.Sprintf("%d of %d nodes succeeded, %d failed", run.status.Succeeded, run.status.Desired, run.status.Failed)
	}
	run.status.Phase = v1alpha1.PhaseScheduled
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionLastRunComplete, Status: status,
		Reason: reason, Message: msg, ObservedGeneration: run.gen})
	meta.SetStatusCondition(&run.status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionFalse,
		Reason: reason, Message: msg, ObservedGeneration: run.gen})
	meta.RemoveStatusCondition(&run.status.Conditions, v1alpha1.ConditionPaused)
	id := run.status.RolloutID
	run.markLocked(false)
	run.mu.Unlock()
	if run.flushSync() == nil {
		run.event(evType, reason, "Run %s: %s", id, msg)
	}
}
