package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
)

// TestControllerRunsObjects runs the controller (the agent's controller worker, as the central Deployment
// runs it) against a real kube-apiserver with the chart's CRDs, over hollow agents with their real workers:
// an ImageGC with an empty spec gets the defaults and runs the kubelet's policy everywhere; one in AllUnused
// mode frees every image and counts the bytes; a refused edit; an ImagePrePull paused before its first wave
// acts on no node until resumed; a controller killed in the middle of a wave is replaced and the new one
// finishes the rollout acting on no node twice; a failure over the budget fails the object with the node
// and its reason; a finished object past its TTL is deleted.
func TestControllerRunsObjects(t *testing.T) {
	const nodes, images = 6, 2
	kc := kubelab.StartT(t, kubelab.Options{})
	ctx := t.Context()
	cl := controllerClient(t, kc.AdminConfig())
	applyCRDs(t, cl)

	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	h := startHollow(t, bin, "hollow", url, nodes, "--images-per-node", fmt.Sprint(images), "--pull-delay", "2s")
	all, _ := waitReady(t, b, h, "hollow-", nodes, 2*time.Minute)
	ctl := startController(t, bin, url, kc, "ctl-1")
	parent := t // the replacement controller outlives its subtest

	t.Run("an empty ImageGC runs the kubelet's policy on every node", func(t *testing.T) {
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-defaults"}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		s := o.Spec
		if s.Mode != "" || controller.GCMode(s) != "KubeletPolicy" || s.DryRun || s.Waves.InitialBatch != 1 || s.Waves.MaxInFlight != 1000 || s.NodeTimeout == nil || s.NodeTimeout.Duration != time.Minute ||
			s.FailureBudget != intstr.FromInt32(0) || s.Nodes.Selector != nil || len(s.Nodes.Names) != 0 {
			t.Errorf("defaults: %+v", s)
		}
		st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		if st.Desired != nodes || st.Succeeded != nodes || st.Failed != 0 || st.BytesFreed != 0 || st.Progress != "6/6" || st.Phase != v1alpha1.PhaseComplete {
			t.Errorf("status: %+v", st)
		}
	})

	t.Run("an ImageGC with only images removes them from every node", func(t *testing.T) {
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-named"},
			Spec: v1alpha1.ImageGCSpec{Images: []string{"registry.local/hollow/app0:v1"}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		if st.Succeeded != nodes || st.ImagesRemoved != nodes || st.BytesFreed != nodes*10<<20 {
			t.Errorf("status: %+v", st)
		}
		// Named goes with images: the API server refuses a mode that does not.
		bad := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-named-bad"},
			Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused", Images: []string{"x"}}}
		if err := cl.Create(ctx, bad); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "mode Named goes with images") {
			t.Errorf("AllUnused with images: %v", err)
		}
	})

	t.Run("AllUnused frees every image, counted as it goes", func(t *testing.T) {
		before, err := streamEnd(ctx, b, events.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-all"}, Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused"}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionComplete)
		if st.Desired != nodes || st.Succeeded != nodes || st.Failed != 0 || st.Active != 0 || st.ImagesRemoved != nodes*(images-1) ||
			st.BytesFreed != nodes*(images-1)*10<<20 || !slices.Equal(st.Waves, []int32{1, 2, 3}) || st.CurrentWave != 3 ||
			st.ObservedGeneration != 1 || st.StartTime == nil || st.CompletionTime == nil || st.RolloutID != "gc-"+string(o.UID) ||
			c.Reason != "Completed" || c.Message != "6 of 6 nodes succeeded, 0 failed" ||
			meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionProgressing) {
			t.Errorf("status: %+v", st)
		}
		waitGCFinishedOnceEach(t, ctx, b, all, before, false, time.Minute)
		reasons := objectEvents(t, kc, o.Name, "Completed")
		// The API server's Events aggregate a repeated reason into a series: the three waves are one Event.
		if want := []string{"Started", "WaveStarted", "Completed"}; !slices.Equal(reasons, want) {
			t.Errorf("events %v, want %v", reasons, want)
		}

		// A started object's spec is immutable but for pause and the in-flight limit: the API server says so.
		err = cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"mode":"KubeletPolicy"}}`)))
		if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "mode is immutable") {
			t.Errorf("edit of spec.mode: %v", err)
		}
		if err := cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"paused":true,"waves":{"maxInFlight":10}}}`))); err != nil {
			t.Errorf("edit of spec.paused and waves.maxInFlight: %v", err)
		}
	})

	image := "registry.example/warm:v1"
	t.Run("a paused ImagePrePull acts on no node until resumed", func(t *testing.T) {
		before, err := streamEnd(ctx, b, events.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		o := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm"},
			Spec: v1alpha1.ImagePrePullSpec{Images: []string{image}, RolloutSpec: v1alpha1.RolloutSpec{Paused: true}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitCondition(t, cl, o, v1alpha1.ConditionPaused)
		if st.Phase != v1alpha1.PhasePaused || st.CurrentWave != 1 || st.Succeeded != 0 || st.Desired != nodes {
			t.Errorf("paused status: %+v", st)
		}
		// The wave waits at its start, before any claim: the rollout stream holds none.
		claims, _, err := rolloutRecordsPerNode(ctx, b, st.RolloutID)
		if err != nil || len(claims) != 0 {
			t.Errorf("claims while paused: %v (%v)", claims, err)
		}
		if err := cl.Patch(ctx, o, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"paused":false}}`))); err != nil {
			t.Fatal(err)
		}
		st = waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		if st.Succeeded != nodes || st.Failed != 0 || meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionPaused) {
			t.Errorf("status: %+v", st)
		}
		counts, err := pullResultsPerNode(ctx, b, before, st.RolloutID)
		if err != nil {
			t.Fatal(err)
		}
		if bad := onceEach(all, counts); bad != "" {
			t.Errorf("pull results: %s", bad)
		}
	})

	t.Run("a controller killed mid-wave is replaced and acts on no node twice", func(t *testing.T) {
		before, err := streamEnd(ctx, b, events.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		o := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm-restart"},
			Spec: v1alpha1.ImagePrePullSpec{Images: []string{"registry.example/warm:v2"},
				RolloutSpec: v1alpha1.RolloutSpec{FailureBudget: intstr.FromString("50%")}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		// Each pull takes 2 s: the second wave is at work for that long after its start is written.
		bustest.Eventually(t, "the second wave started", time.Minute, func() error {
			if err := cl.Get(ctx, client.ObjectKeyFromObject(o), o); err != nil {
				return err
			}
			if o.Status.CurrentWave < 2 {
				return fmt.Errorf("wave %d", o.Status.CurrentWave)
			}
			return nil
		})
		ctl.stop(syscall.SIGKILL)
		ctl = startController(parent, bin, url, kc, "ctl-2")
		st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		if st.Desired != nodes || st.Succeeded+st.Failed != nodes || st.Succeeded < nodes-2 {
			t.Errorf("status: %+v", st)
		}
		for _, f := range st.FailedNodes {
			if !strings.Contains(f.Reason, "without a recorded outcome; not acted on again") {
				t.Errorf("failed node %s: %q", f.Node, f.Reason)
			}
		}
		counts, err := pullResultsPerNode(ctx, b, before, st.RolloutID)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range all {
			if counts[n] > 1 {
				t.Errorf("node %s pulled %d times", n, counts[n])
			}
		}
		// Every node was claimed once; a node the killed controller had claimed is not acted on again and
		// its failure is not recorded as an outcome on the bus (only in the status); every other node's
		// outcome is recorded once.
		claims, results, err := rolloutRecordsPerNode(ctx, b, st.RolloutID)
		if err != nil {
			t.Fatal(err)
		}
		if bad := onceEach(all, claims); bad != "" {
			t.Errorf("claims: %s", bad)
		}
		var acted []string
		for _, n := range all {
			if !slices.ContainsFunc(st.FailedNodes, func(f v1alpha1.NodeFailure) bool { return f.Node == n }) {
				acted = append(acted, n)
			}
		}
		if bad := onceEach(acted, results); bad != "" {
			t.Errorf("outcomes: %s", bad)
		}
	})

	t.Run("a failure over the budget fails the object", func(t *testing.T) {
		// Waves [h0] [gone-1 h1] [h2]: gone-1 fails the second wave, so the third never starts.
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-fail"}, Spec: v1alpha1.ImageGCSpec{DryRun: true,
			RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Names: []string{all[0], "gone-1", all[1], all[2]}},
				NodeTimeout: &metav1.Duration{Duration: 2 * time.Second}}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		st := waitCondition(t, cl, o, v1alpha1.ConditionFailed)
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionFailed)
		if st.Phase != v1alpha1.PhaseFailed || st.Succeeded != 2 || st.Failed != 1 || c.Reason != "FailureBudgetExceeded" ||
			c.Message != "1 of 4 nodes failed, over the failure budget 0 (0); 1 not started" || !slices.Equal(st.Waves, []int32{1, 2, 1}) ||
			!slices.Equal(st.FailedNodes, []v1alpha1.NodeFailure{{Node: "gone-1", Reason: "no answer within the node timeout 2s"}}) {
			t.Errorf("status: %+v", st)
		}
		reasons := objectEvents(t, kc, o.Name, "FailureBudgetExceeded")
		if !slices.Contains(reasons, "NodeFailed") {
			t.Errorf("events %v", reasons)
		}
	})

	t.Run("fleet gc --object hands the rollout to the controller", func(t *testing.T) {
		// No NATS credentials: the command reaches only the API server.
		cmd := exec.Command(bin, "fleet", "gc", "--object", "gc-cli", "--kubeconfig", kc.KubeconfigPath("admin"), "--dry-run",
			"--nodes", all[0]+","+all[1], "--max-failures", "50%", "--node-timeout", "30s")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "imagegc.imagefleet.io/gc-cli created") {
			t.Fatalf("fleet gc --object: %v\n%s", err, out)
		}
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-cli"}}
		st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
		if st.Desired != 2 || st.Succeeded != 2 || !o.Spec.DryRun || o.Spec.FailureBudget != intstr.FromString("50%") ||
			o.Spec.NodeTimeout.Duration != 30*time.Second || !slices.Equal(o.Spec.Nodes.Names, all[:2]) {
			t.Errorf("spec %+v, status %+v", o.Spec, st)
		}
		out, err = exec.Command(bin, "fleet", "gc", "--object", "gc-cli-id", "--id", "x", "--kubeconfig", kc.KubeconfigPath("admin")).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--id and --object exclude each other") {
			t.Errorf("--id with --object: %v\n%s", err, out)
		}
	})

	t.Run("a finished object past its TTL is deleted", func(t *testing.T) {
		ttl := int32(1)
		o := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-ttl"}, Spec: v1alpha1.ImageGCSpec{DryRun: true,
			RolloutSpec: v1alpha1.RolloutSpec{TTLSecondsAfterFinished: &ttl}}}
		if err := cl.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		bustest.Eventually(t, "gc-ttl deleted", time.Minute, func() error {
			err := cl.Get(ctx, client.ObjectKeyFromObject(o), o)
			if apierrors.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			return fmt.Errorf("still there, phase %q", o.Status.Phase)
		})
	})
}

// controllerClient is a controller-runtime client of cfg that knows the project's kinds.
func controllerClient(t testing.TB, cfg *rest.Config) client.Client {
	t.Helper()
	scheme, err := controller.Scheme()
	if err != nil {
		t.Fatal(err)
	}
	controller.UseLogger(slog.Default())
	cl, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return cl
}

// applyCRDs creates the chart's CustomResourceDefinitions and waits until the API server serves them.
func applyCRDs(t testing.TB, cl client.Client) {
	t.Helper()
	paths, err := filepath.Glob("../deploy/helm/imagefleet/files/crds/*.yaml")
	if err != nil || len(paths) == 0 {
		t.Fatalf("the chart's CRDs: %v (%d files)", err, len(paths))
	}
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(raw, &u.Object); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if err := cl.Create(t.Context(), u); err != nil {
			t.Fatalf("create %s: %v", p, err)
		}
		bustest.Eventually(t, "CRD "+u.GetName()+" Established", time.Minute, func() error {
			got := &unstructured.Unstructured{}
			got.SetGroupVersionKind(u.GroupVersionKind())
			if err := cl.Get(t.Context(), client.ObjectKeyFromObject(u), got); err != nil {
				return err
			}
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conds {
				m, _ := c.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					return nil
				}
			}
			return fmt.Errorf("conditions %v", conds)
		})
	}
}

// startController runs the agent's controller worker on the lab's admin kubeconfig, its Lease in default.
func startController(t testing.TB, bin, url string, kc *kubelab.Cluster, name string) *proc {
	t.Helper()
	runningController = startProc(t, name, bin, "agent", "--node", name, "--workers", "controller", "--nats", url,
		"--kubeconfig", kc.KubeconfigPath("admin"), "--controller-namespace", "default", "--data-dir", t.TempDir(), "--no-journal")
	return runningController
}

// waitCondition waits until o's condition is True and returns o's status then.
func waitCondition(t testing.TB, cl client.Client, o client.Object, cond string) v1alpha1.RolloutStatus {
	t.Helper()
	return waitConditionWithin(t, cl, o, cond, 2*time.Minute)
}

// waitConditionWithin is waitCondition with its own timeout (a large fleet's rollout takes longer).
func waitConditionWithin(t testing.TB, cl client.Client, o client.Object, cond string, timeout time.Duration) v1alpha1.RolloutStatus {
	t.Helper()
	var st *v1alpha1.RolloutStatus
	var last error
	for deadline := time.Now().Add(timeout); ; {
		last = cl.Get(t.Context(), client.ObjectKeyFromObject(o), o)
		if last == nil {
			switch x := o.(type) {
			case *v1alpha1.ImageGC:
				st = &x.Status
			case *v1alpha1.ImagePrePull:
				st = &x.Status
			}
			if meta.IsStatusConditionTrue(st.Conditions, cond) {
				return *st
			}
			last = fmt.Errorf("phase %q, progress %q, failed nodes %v, conditions %+v", st.Phase, st.Progress, st.FailedNodes, st.Conditions)
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond) // polling the API server, as waiting on a watch would
	}
	// What the controller was doing: its goroutines in the log.
	if tt, ok := t.(*testing.T); ok && runningController != nil {
		dumpAgent(tt, runningController)
	}
	t.Fatalf("%s not %s after %s: %v", o.GetName(), cond, timeout, last)
	return v1alpha1.RolloutStatus{}
}

// runningController is the controller the test started last: waitConditionWithin dumps its goroutines
// when it waits in vain.
var runningController *proc

// objectEvents returns the reasons of the Events about the cluster-scoped object name, oldest first, once
// the last one is last (the recorder posts them in the background).
func objectEvents(t testing.TB, kc *kubelab.Cluster, name, last string) []string {
	t.Helper()
	return objectEventsUntil(t, kc, name, func(reasons []string) bool { return len(reasons) > 0 && reasons[len(reasons)-1] == last })
}

// objectEventsUntil waits until the reasons of the Events regarding the object name, in the order they were
// made, satisfy done, and returns them. The recorder posts each Event on its own, so one made before
// another may be stored after it: a check of the whole list waits for the whole list.
func objectEventsUntil(t testing.TB, kc *kubelab.Cluster, name string, done func([]string) bool) []string {
	t.Helper()
	cs, err := kc.Admin()
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	bustest.Eventually(t, "the Events of "+name, 30*time.Second, func() error {
		list, err := cs.EventsV1().Events(corev1.NamespaceDefault).List(context.Background(), metav1.ListOptions{
			FieldSelector: "regarding.name=" + name})
		if err != nil {
			return err
		}
		evs := list.Items
		slices.SortFunc(evs, func(a, b eventsv1.Event) int { return a.EventTime.Compare(b.EventTime.Time) })
		reasons = reasons[:0]
		for _, e := range evs {
			reasons = append(reasons, e.Reason)
		}
		if !done(reasons) {
			return fmt.Errorf("reasons so far %v", reasons)
		}
		return nil
	})
	return reasons
}

// waitGCFinishedOnceEach waits until each of nodes has published exactly one gc.finished of a rollout's
// pass after seq (dry run as asked).
func waitGCFinishedOnceEach(t testing.TB, ctx context.Context, b *bus.Bus, nodes []string, after uint64, dryRun bool, timeout time.Duration) {
	t.Helper()
	bustest.Eventually(t, "one gc.finished from each node", timeout, func() error {
		counts, err := gcFinishedPerNode(ctx, b, after, dryRun)
		if err != nil {
			return err
		}
		if bad := onceEach(nodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})
}
