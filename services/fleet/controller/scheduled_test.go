package controller

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

// steppingWriter steps the clock by step on each status write: the time a write takes, on a fake clock.
type steppingWriter struct {
	client.SubResourceWriter
	clk    *clocktesting.FakeClock
	step   time.Duration
	writes int
}

func (w *steppingWriter) Patch(context.Context, client.Object, client.Patch, ...client.SubResourcePatchOption) error {
	w.writes++
	w.clk.Step(w.step)
	return nil
}

// steppingClock steps the clock by step inside its first AfterFunc, before the timer is set: the clock
// moving on between the delay's reading and the timer's setting.
type steppingClock struct {
	*clocktesting.FakeClock
	step time.Duration
}

func (c *steppingClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	if c.step > 0 {
		c.FakeClock.Step(c.step)
		c.step = 0
	}
	return c.FakeClock.AfterFunc(d, f)
}

func scheduleReconciler(t *testing.T, clk clock.WithTickerAndDelayedExecution, w client.SubResourceWriter) *reconciler {
	t.Helper()
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return &reconciler{kind: gcKind(), status: w, m: m, log: slog.New(slog.DiscardHandler), rec: discardRecorder{},
		base: t.Context(), cfg: Config{Clock: clk, StatusInterval: time.Hour}, runners: map[string]*runner{}}
}

// woken reports whether name was enqueued; a fake clock's timers run inside its Step and SetTime, so a
// wake-up due by now is already in the channel.
func woken(r *reconciler) bool {
	select {
	case ev := <-r.wakeups():
		return ev.Object.GetName() != ""
	default:
		return false
	}
}

// TestScheduleWakesAtTheNextFiringAfterASlowWrite: the reconcile after a run writes the idle status and
// then sets the timer for the next firing. The time the write took (here 58 minutes of a fake clock) does
// not delay the wake-up: it comes when the clock reaches the firing, not the write's time after it.
func TestScheduleWakesAtTheNextFiringAfterASlowWrite(t *testing.T) {
	fired := mustTime(t, "2026-11-28T22:30:00Z")
	clk := clocktesting.NewFakeClock(fired.Add(time.Minute))
	w := &steppingWriter{clk: clk, step: 58 * time.Minute}
	r := scheduleReconciler(t, clk, w)
	done := metav1.NewTime(fired.Add(5 * time.Second))
	o := &v1alpha1.ImageGC{
		ObjectMeta: metav1.ObjectMeta{Name: "gc-hourly", UID: "u", CreationTimestamp: metav1.NewTime(fired.Add(-2 * time.Hour))},
		Spec:       v1alpha1.ImageGCSpec{Mode: "AllUnused", Schedule: "@hourly", TimeZone: "Asia/Kolkata"},
		Status: v1alpha1.RolloutStatus{Phase: v1alpha1.PhaseScheduled, RolloutID: runID("u", fired),
			LastScheduleTime: &metav1.Time{Time: fired}, StartTime: &metav1.Time{Time: fired}, CompletionTime: &done},
	}
	if _, err := r.reconcileScheduled(t.Context(), o); err != nil {
		t.Fatal(err)
	}
	if w.writes != 1 {
		t.Fatalf("%d status writes, want 1 (the next firing)", w.writes)
	}
	next := fired.Add(time.Hour)
	clk.SetTime(next.Add(-time.Second))
	if woken(r) {
		t.Fatalf("woken at %s, before the next firing at %s", clk.Now(), next)
	}
	clk.SetTime(next)
	if !woken(r) {
		t.Fatalf("not woken at the next firing %s", next)
	}
}

// TestWakeAtSetsTheTimerAgainWhenTheClockMoves: a clock that moves on while the timer is being set would
// make the timer late by as much; the timer is set again from the new time.
func TestWakeAtSetsTheTimerAgainWhenTheClockMoves(t *testing.T) {
	start := mustTime(t, "2026-11-28T22:31:00Z")
	clk := &steppingClock{FakeClock: clocktesting.NewFakeClock(start), step: 58 * time.Minute}
	r := scheduleReconciler(t, clk, nil)
	at := start.Add(59 * time.Minute)
	st := &scheduled{}
	r.wakeAt("gc", st, at)
	clk.SetTime(at)
	if !woken(r) {
		t.Fatalf("not woken at %s", at)
	}
}

// TestWakeAtATimeAlreadyReached: a wake-up whose time has come enqueues at once, without waiting for the
// clock to move (a fake clock's zero-delay timer fires only at its next step).
func TestWakeAtATimeAlreadyReached(t *testing.T) {
	now := mustTime(t, "2026-11-28T22:31:00Z")
	clk := clocktesting.NewFakeClock(now)
	r := scheduleReconciler(t, clk, nil)
	r.wakeAt("gc", &scheduled{}, now.Add(-time.Second))
	select {
	case <-r.wakeups():
	case <-time.After(10 * time.Second):
		t.Fatal("a wake-up already due was not enqueued")
	}
}
