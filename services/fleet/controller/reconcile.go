package controller

import (
	"context"
	"log/slog"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
)

// reconciler keeps one runner per object of its kind. It is level-based: each call reads the object and
// decides from what it sees, starting the object's runner, passing it the current spec (pause, in-flight
// limit), or deleting a finished object whose TTL has passed.
type reconciler struct {
	kind kind
	c    client.Client
	// status writes the objects' status subresource (c.Status()).
	status client.SubResourceWriter
	b      *bus.Bus
	rec    recorder.EventRecorder
	cfg    Config
	log    *slog.Logger
	m      *metrics
	// keep follows the KeepNewNodes ImagePrePulls (nil for ImageGC): newnodes*.go.
	keep *keeper

	base context.Context // Run's: the runners end with the controller (Run stops them before it returns)

	mu      sync.Mutex
	runners map[string]*runner
	sched   map[string]*scheduled   // scheduled ImageGCs (scheduled.go)
	wake    chan event.GenericEvent // the schedule's wake-ups (wakeSource)
}

// Reconcile implements reconcile.Reconciler.
func (r *reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	obj := r.kind.newObject()
	if err := r.c.Get(ctx, req.NamespacedName, obj); err != nil {
		if apierrors.IsNotFound(err) {
			r.forget(req.Name)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	if obj.GetDeletionTimestamp() != nil {
		r.forget(req.Name)
		return ctrl.Result{}, nil
	}
	r.keep.observe(obj)
	if o, ok := scheduledGC(obj); ok {
		return r.reconcileScheduled(ctx, o)
	}
	if finished(r.kind.status(obj)) {
		return r.expire(ctx, obj)
	}
	r.mu.Lock()
	run := r.runners[req.Name]
	if run != nil && run.uid != obj.GetUID() { // deleted and made again under the same name
		delete(r.runners, req.Name)
		r.mu.Unlock()
		run.stop()
		r.mu.Lock()
		run = nil
	}
	if run == nil {
		run = newRunner(r.base, r, obj)
		run.update(obj) // before it runs: the rollout is planned with the spec
		r.runners[req.Name] = run
		go run.run()
	} else {
		run.update(obj)
	}
	r.mu.Unlock()
	return ctrl.Result{}, nil
}

// finished reports whether the object completed or failed.
func finished(st *v1alpha1.RolloutStatus) bool {
	return meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionComplete) ||
		meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionFailed)
}

// expire deletes a finished object once its ttlSecondsAfterFinished has passed, and asks to be called
// again when it will have.
func (r *reconciler) expire(ctx context.Context, obj client.Object) (ctrl.Result, error) {
	ttl := r.kind.spec(obj).TTLSecondsAfterFinished
	done := r.kind.status(obj).CompletionTime
	if ttl == nil || done == nil {
		return ctrl.Result{}, nil
	}
	if left := time.Until(done.Add(time.Duration(*ttl) * time.Second)); left > 0 {
		return ctrl.Result{RequeueAfter: left}, nil
	}
	uid := obj.GetUID()
	err := r.c.Delete(ctx, obj, client.Preconditions{UID: &uid}, client.PropagationPolicy("Background"))
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return ctrl.Result{}, err
	}
	r.log.Info("deleted finished object past its TTL", "name", obj.GetName(), "ttl_seconds", *ttl)
	r.forget(obj.GetName())
	return ctrl.Result{}, nil
}

// forget stops and drops the runner of name, if any.
func (r *reconciler) forget(name string) {
	r.mu.Lock()
	run := r.runners[name]
	delete(r.runners, name)
	r.mu.Unlock()
	if run != nil {
		run.stop()
	}
	r.forgetSchedule(name)
	r.keep.forget(name)
}

// stopAll stops every runner (the controller stops or lost the Lease: the next holder resumes them).
func (r *reconciler) stopAll() {
	r.mu.Lock()
	runs := r.runners
	r.runners = map[string]*runner{}
	r.mu.Unlock()
	for _, run := range runs {
		run.stop()
	}
}
