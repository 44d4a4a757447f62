package integration_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
)

// TestControllerSchedulesImageGC runs the controller in this process on a fake clock, against a real
// kube-apiserver with the chart's CRDs, over hollow agents with their real workers: the schema refuses
// what it can check; an hourly schedule in Asia/Kolkata fires at :30 UTC, once, each run one rollout that
// acts on every node once, and again at the next firing; a window that ends while the first wave is at work
// starts no later wave and says how many nodes were not started; a controller stopped mid-run is replaced
// and resumes the firing's rollout without starting the firing again; a paused schedule skips its firing;
// an unknown time zone is a condition and an Event, mended by an edit.
func TestControllerSchedulesImageGC(t *testing.T) {
	const nodes = 4
	kc := kubelab.StartT(t, kubelab.Options{})
	ctx := t.Context()
	cl := controllerClient(t, kc.AdminConfig())
	applyCRDs(t, cl)

	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	h := startHollow(t, bin, "hollow", url, nodes, "--images-per-node", "2")
	all, _ := waitReady(t, b, h, "hollow-", nodes, 2*time.Minute)

	t.Run("the schema refuses what it can check", func(t *testing.T) {
		window := func(d time.Duration) *metav1.Duration { return &metav1.Duration{Duration: d} }
		ttl := int32(60)
		for _, tc := range []struct {
			name string
			spec v1alpha1.ImageGCSpec
			msg  string
		}{
			{"tz-in-schedule", v1alpha1.ImageGCSpec{Schedule: "CRON_TZ=UTC 0 3 * * *"}, "must not set a time zone (TZ= or CRON_TZ=): use timeZone"},
			{"short-window", v1alpha1.ImageGCSpec{Schedule: "@daily", Window: window(30 * time.Second)}, "window must be at least 1m"},
			{"tz-alone", v1alpha1.ImageGCSpec{TimeZone: "UTC"}, "timeZone goes with schedule"},
			{"window-alone", v1alpha1.ImageGCSpec{Window: window(time.Hour)}, "window goes with schedule"},
			{"local", v1alpha1.ImageGCSpec{Schedule: "@daily", TimeZone: "Local"}, "timeZone must name a time zone, not Local"},
			{"ttl", v1alpha1.ImageGCSpec{Schedule: "@daily", RolloutSpec: v1alpha1.RolloutSpec{TTLSecondsAfterFinished: &ttl}},
				"ttlSecondsAfterFinished does not apply"},
		} {
			o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "bad-" + tc.name}, Spec: tc.spec}
			if err := cl.Create(ctx, o); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("%s: %v, want Invalid with %q", tc.name, err, tc.msg)
			}
		}
		// A schedule is not added to an object made without one (nor removed).
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-once"}, Spec: v1alpha1.ImageGCSpec{DryRun: true, RolloutSpec: v1alpha1.RolloutSpec{Paused: true}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		err := cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"schedule":"@daily"}}`)))
		if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "schedule may be changed but not added or removed") {
			t.Errorf("schedule added: %v", err)
		}
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("an hourly schedule runs once per firing, in its time zone", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Now())
		runControllerInProcess(t, kc, url, clk)
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-hourly"},
			Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused", DryRun: true, Schedule: "@hourly", TimeZone: "Asia/Kolkata"}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitStatus(t, cl, o, "the first nextScheduleTime", func(st v1alpha1.RolloutStatus) bool { return st.NextScheduleTime != nil })
		first := st.NextScheduleTime.UTC()
		if first.Minute() != 30 || first.Second() != 0 || st.LastScheduleTime != nil || st.Phase != v1alpha1.PhaseScheduled ||
			!meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionScheduled) || st.RolloutID != "" {
			t.Errorf("before the first firing: %+v", st)
		}

		runOnce := func(t *testing.T, fired time.Time) v1alpha1.RolloutStatus {
			before, err := streamEnd(ctx, b, events.EventsStream)
			if err != nil {
				t.Fatal(err)
			}
			clk.SetTime(fired)
			st := waitStatus(t, cl, o, "the run of "+fired.String()+" ended", func(st v1alpha1.RolloutStatus) bool {
				return st.LastScheduleTime != nil && st.LastScheduleTime.Equal(&metav1.Time{Time: fired}) && st.CompletionTime != nil
			})
			c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionLastRunComplete)
			if c == nil || c.Status != metav1.ConditionTrue || c.Reason != "Completed" || c.Message != fmt.Sprintf("%d of %d nodes succeeded, 0 failed", nodes, nodes) ||
				st.Desired != nodes || st.Succeeded != nodes || st.Failed != 0 || st.Phase != v1alpha1.PhaseScheduled ||
				st.RolloutID != fmt.Sprintf("gc-%s-%d", o.UID, fired.Unix()) || !st.NextScheduleTime.Time.Equal(fired.Add(time.Hour)) ||
				meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionProgressing) || meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionComplete) {
				t.Errorf("after the run of %s: %+v", fired, st)
			}
			// One rollout for the firing: every node claimed once and its GC run once.
			claims, _, err := rolloutRecordsPerNode(ctx, b, st.RolloutID)
			if err != nil {
				t.Fatal(err)
			}
			if bad := onceEach(all, claims); bad != "" {
				t.Errorf("claims of %s: %s", st.RolloutID, bad)
			}
			waitGCFinishedOnceEach(t, ctx, b, all, before, true, 30*time.Second)
			return st
		}
		runOnce(t, first)
		want := []string{"RunStarted", "WaveStarted", "Completed"}
		if reasons := objectEventsUntil(t, kc, o.Name, func(r []string) bool { return slices.Equal(r, want) }); !slices.Equal(reasons, want) {
			t.Errorf("events %v, want %v", reasons, want)
		}
		// Nothing more happens until the next firing: the status stays where the first run left it.
		clk.SetTime(first.Add(59 * time.Minute))
		if err := cl.Get(ctx, client.ObjectKeyFromObject(o), o); err != nil || !o.Status.LastScheduleTime.Time.Equal(first) {
			t.Errorf("before the second firing: %+v (%v)", o.Status, err)
		}
		runOnce(t, first.Add(time.Hour))
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a window that ends in the first wave starts no later wave", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Now())
		runControllerInProcess(t, kc, url, clk)
		// Waves [gone-1] [h0 h1] [h2 h3]: gone-1 is held by the test, so the first wave is at work until the
		// test has ended the window; then gone-1 fails.
		asked, release := heldNode(t, b, "gone-1")
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-window"}, Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused", DryRun: true,
			Schedule: "0 3 * * *", TimeZone: "Europe/Berlin", Window: &metav1.Duration{Duration: 10 * time.Minute},
			RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Names: append([]string{"gone-1"}, all...)},
				NodeTimeout: &metav1.Duration{Duration: 5 * time.Minute}, FailureBudget: intstr.FromInt32(1)}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitStatus(t, cl, o, "the first nextScheduleTime", func(st v1alpha1.RolloutStatus) bool { return st.NextScheduleTime != nil })
		fired := st.NextScheduleTime.Time
		if berlin, _ := time.LoadLocation("Europe/Berlin"); fired.In(berlin).Hour() != 3 {
			t.Errorf("next firing %s is not 03:00 in Berlin", fired)
		}
		clk.SetTime(fired)
		waitAsked(t, asked, "gone-1")
		waitStatus(t, cl, o, "the first wave at work", func(st v1alpha1.RolloutStatus) bool {
			return st.LastScheduleTime != nil && st.LastScheduleTime.Equal(&metav1.Time{Time: fired}) && st.CurrentWave == 1 && st.CompletionTime == nil
		})
		clk.Step(11 * time.Minute) // the window ends while gone-1 is waited for
		release()
		st = waitStatus(t, cl, o, "the run ended", func(st v1alpha1.RolloutStatus) bool { return st.CompletionTime != nil })
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionLastRunComplete)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != "WindowEnded" ||
			c.Message != "the window 10m0s ended before wave 2: 0 of 5 nodes succeeded, 1 failed, 4 not started" ||
			st.Failed != 1 || st.Succeeded != 0 || st.Desired != 5 || st.CurrentWave != 1 || st.Phase != v1alpha1.PhaseScheduled {
			t.Errorf("status: %+v", st)
		}
		claims, _, err := rolloutRecordsPerNode(ctx, b, st.RolloutID)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range all {
			if claims[n] != 0 {
				t.Errorf("node %s of a wave that never started claimed %d times", n, claims[n])
			}
		}
		// The rollout ended on the bus too: its finished record says why.
		fctx, fcancel := context.WithTimeout(ctx, 30*time.Second)
		var fin *events.RolloutResult
		err = fleet.FollowRollout(fctx, b, st.RolloutID, func(ev fleet.RolloutEvent) bool {
			fin = ev.Finished
			return fin == nil
		})
		fcancel()
		if err != nil || fin == nil || fin.StopReason != "WindowEnded" || fin.FailedTotal() != 1 || !slices.Equal(fin.Batches, []int{1}) {
			t.Errorf("finished record of %s: %+v, %v", st.RolloutID, fin, err)
		}
		reasons := objectEvents(t, kc, o.Name, "WindowEnded")
		if !slices.Contains(reasons, "RunStarted") || !slices.Contains(reasons, "NodeFailed") {
			t.Errorf("events %v", reasons)
		}
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a controller stopped mid-run is replaced and resumes the firing's rollout", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Now())
		stop := runControllerInProcess(t, kc, url, clk)
		before, err := streamEnd(ctx, b, events.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		// gone-1, the first wave, is held by the test until the controller is stopped: stopped mid-run.
		asked, release := heldNode(t, b, "gone-1")
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-resume"}, Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused", DryRun: true,
			Schedule: "*/10 * * * *", RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Names: append([]string{"gone-1"}, all...)},
				NodeTimeout: &metav1.Duration{Duration: 5 * time.Minute}, FailureBudget: intstr.FromInt32(1)}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitStatus(t, cl, o, "the first nextScheduleTime", func(st v1alpha1.RolloutStatus) bool { return st.NextScheduleTime != nil })
		fired := st.NextScheduleTime.Time
		clk.SetTime(fired)
		waitAsked(t, asked, "gone-1")
		st = waitStatus(t, cl, o, "the first wave at work", func(st v1alpha1.RolloutStatus) bool {
			return st.LastScheduleTime != nil && st.LastScheduleTime.Equal(&metav1.Time{Time: fired}) && st.CurrentWave == 1
		})
		id := st.RolloutID
		stop()
		release() // its answer reaches nobody: gone-1's outcome is not recorded, its claim is
		// The next controller's clock is half a minute on: the firing is still within its deadline, and must
		// not start again.
		runControllerInProcess(t, kc, url, clocktesting.NewFakeClock(fired.Add(30*time.Second)))
		st = waitStatus(t, cl, o, "the run ended", func(st v1alpha1.RolloutStatus) bool { return st.CompletionTime != nil })
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionLastRunComplete)
		if st.RolloutID != id || !st.LastScheduleTime.Time.Equal(fired) || st.Succeeded != nodes || st.Failed != 1 ||
			c == nil || c.Status != metav1.ConditionTrue || c.Reason != "CompletedWithFailures" {
			t.Errorf("status: %+v", st)
		}
		claims, _, err := rolloutRecordsPerNode(ctx, b, id)
		if err != nil {
			t.Fatal(err)
		}
		if bad := onceEach(append([]string{"gone-1"}, all...), claims); bad != "" {
			t.Errorf("claims: %s", bad)
		}
		counts, err := gcFinishedPerNode(ctx, b, before, true)
		if err != nil {
			t.Fatal(err)
		}
		if bad := onceEach(all, counts); bad != "" {
			t.Errorf("gc.finished: %s", bad)
		}
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a paused schedule skips its firing and runs the next once resumed", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Now())
		runControllerInProcess(t, kc, url, clk)
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-paused"}, Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused", DryRun: true,
			Schedule: "*/10 * * * *", RolloutSpec: v1alpha1.RolloutSpec{Paused: true}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitStatus(t, cl, o, "the first nextScheduleTime", func(st v1alpha1.RolloutStatus) bool { return st.NextScheduleTime != nil })
		fired := st.NextScheduleTime.Time
		clk.SetTime(fired)
		// Held until its deadline (1m without a window), then skipped.
		clk.Step(61 * time.Second)
		if reasons := objectEvents(t, kc, o.Name, "ScheduleSkipped"); !slices.Equal(reasons, []string{"ScheduleSkipped"}) {
			t.Errorf("events %v", reasons)
		}
		st = waitStatus(t, cl, o, "the next firing", func(st v1alpha1.RolloutStatus) bool {
			return st.NextScheduleTime != nil && st.NextScheduleTime.Time.Equal(fired.Add(10*time.Minute))
		})
		if st.LastScheduleTime != nil || st.RolloutID != "" || st.Phase != v1alpha1.PhaseScheduled {
			t.Errorf("a paused schedule ran: %+v", st)
		}
		if err := cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"paused":false}}`))); err != nil {
			t.Fatal(err)
		}
		clk.SetTime(fired.Add(10 * time.Minute))
		st = waitStatus(t, cl, o, "the next firing's run ended", func(st v1alpha1.RolloutStatus) bool { return st.CompletionTime != nil })
		if !st.LastScheduleTime.Time.Equal(fired.Add(10*time.Minute)) || st.Succeeded != nodes {
			t.Errorf("status: %+v", st)
		}
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("an unknown time zone is a condition and an Event until mended", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Now())
		runControllerInProcess(t, kc, url, clk)
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-mars"},
			Spec: v1alpha1.ImageGCSpec{DryRun: true, Schedule: "0 3 * * *", TimeZone: "Mars/Olympus_Mons"}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitStatus(t, cl, o, "Scheduled False", func(st v1alpha1.RolloutStatus) bool {
			return meta.IsStatusConditionFalse(st.Conditions, v1alpha1.ConditionScheduled)
		})
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionScheduled)
		if c.Reason != "InvalidTimeZone" || !strings.Contains(c.Message, `timeZone "Mars/Olympus_Mons" is not a known IANA time zone`) || st.NextScheduleTime != nil {
			t.Errorf("status: %+v", st)
		}
		if reasons := objectEvents(t, kc, o.Name, "InvalidTimeZone"); len(reasons) != 1 {
			t.Errorf("events %v", reasons)
		}
		if err := cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"timeZone":"Europe/Paris"}}`))); err != nil {
			t.Fatal(err)
		}
		waitStatus(t, cl, o, "Scheduled True", func(st v1alpha1.RolloutStatus) bool {
			return meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionScheduled) && st.NextScheduleTime != nil
		})
	})
}

// runControllerInProcess runs the controller in this test's process on clk until stop is called or the
// test ends, with its own connection to the bus.
func runControllerInProcess(t *testing.T, kc *kubelab.Cluster, url string, clk *clocktesting.FakeClock) (stop func()) {
	t.Helper()
	cb, err := bus.Connect(t.Context(), url, bus.Options{Name: "controller-" + t.Name(), ConnectTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := controller.New(controller.Config{REST: kc.AdminConfig(), NoLeaderElection: true, Identity: "ctl-in-process",
		StatusInterval: 200 * time.Millisecond, Registerer: prometheus.NewRegistry(), Clock: clk}, cb)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("controller: %v", err)
			}
			cb.Close()
		})
	}
	t.Cleanup(stop)
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("controller ended before it was ready: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("controller not ready after 1m")
	}
	return stop
}

// heldNode answers node's GC requests, as an agent of that name would, with a failure, each only once the
// test calls release; asked receives a value as each request arrives. A wave of the node alone is at work
// until the test says so: what the test does meanwhile (step the clock, stop the controller) races no
// timeout.
func heldNode(t *testing.T, b *bus.Bus, node string) (asked <-chan struct{}, release func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ask := make(chan struct{}, 16)
	released := make(chan struct{})
	l, err := b.Listen(ctx, events.CommandSubject(node, events.VerbGC), "", 4, func(hctx context.Context, _ []byte) (any, error) {
		select {
		case ask <- struct{}{}:
		default:
		}
		select {
		case <-released:
		case <-hctx.Done():
		}
		return nil, errors.New("held by the test, then failed")
	})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ctx) }()
	var once sync.Once
	release = func() { once.Do(func() { close(released) }) }
	t.Cleanup(func() {
		release()
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return ask, release
}

// waitAsked waits for a request to a heldNode.
func waitAsked(t *testing.T, asked <-chan struct{}, node string) {
	t.Helper()
	select {
	case <-asked:
	case <-time.After(time.Minute):
		t.Fatalf("%s was not asked within a minute", node)
	}
}
