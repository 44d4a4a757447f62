package integration_test

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
)

// TestControllerWarmsNewNodes runs an ImagePrePull with completionPolicy KeepNewNodes against a real
// kube-apiserver over hollow agents: Node objects registered with the readiness taint; the planned nodes
// warmed and untainted, the object Complete; a node that joins (its Node with the taint, then its agent) is
// warmed by its own one-node rollout and untainted, and counted; a node whose pulls fail (an agent without a
// puller) keeps its taint and is listed as failed; a node the selector leaves out keeps its taint; a
// replaced controller pulls on no warmed node again and still warms the next node that joins.
func TestControllerWarmsNewNodes(t *testing.T) {
	const last = 10 // the hollow processes share the names hollow-00000 ... hollow-00009
	name := func(i int) string { return hollow.NodeName(i, last) }
	kc := kubelab.StartT(t, kubelab.Options{})
	ctx := t.Context()
	cl := controllerClient(t, kc.AdminConfig())
	applyCRDs(t, cl)
	cs, err := kc.Admin()
	if err != nil {
		t.Fatal(err)
	}
	taint := v1alpha1.DefaultReadinessTaint
	for i := range 7 {
		registerNode(t, cs, name(i), taint)
	}

	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	agents := func(proc string, first int, extra ...string) {
		h := startHollow(t, bin, proc, url, 1, append([]string{"--first", fmt.Sprint(first), "--last", fmt.Sprint(last), "--images-per-node", "1"}, extra...)...)
		waitReady(t, b, h, name(first), 1, time.Minute)
	}
	h := startHollow(t, bin, "hollow-a", url, 2, "--last", fmt.Sprint(last), "--images-per-node", "1", "--node-labels", "pool=warm")
	waitReady(t, b, h, "hollow-", 2, time.Minute)
	ctl := startController(t, bin, url, kc, "ctl-1")

	o := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm-new"}, Spec: v1alpha1.ImagePrePullSpec{
		Images: []string{"registry.example/big:v1"}, CompletionPolicy: v1alpha1.CompletionKeepNewNodes,
		RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "warm"}}},
			NodeTimeout: &metav1.Duration{Duration: 3 * time.Second}, Waves: v1alpha1.Waves{InitialBatch: 2}}}}
	if err := cl.Create(ctx, o); err != nil {
		t.Fatal(err)
	}
	// By names: node 6 is not there yet; it is skipped, and warmed when it joins. Node 1's taint waits for
	// both objects.
	named := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm-named"}, Spec: v1alpha1.ImagePrePullSpec{
		Images: []string{"registry.example/named:v1"}, CompletionPolicy: v1alpha1.CompletionKeepNewNodes,
		RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Names: []string{name(1), name(6)}}}}}
	if err := cl.Create(ctx, named); err != nil {
		t.Fatal(err)
	}
	st := waitCondition(t, cl, o, v1alpha1.ConditionComplete)
	if st.Desired != 2 || st.Succeeded != 2 || st.Failed != 0 || o.Spec.ReadinessTaint != "" {
		t.Errorf("first rollout: status %+v", st)
	}
	if st := waitCondition(t, cl, named, v1alpha1.ConditionComplete); st.Desired != 1 || st.Succeeded != 1 || st.Skipped != 1 {
		t.Errorf("first rollout by names: status %+v", st)
	}
	waitTaint(t, cs, name(0), taint, false)
	waitTaint(t, cs, name(1), taint, false)

	// The schema refuses what KeepNewNodes cannot do.
	ttl := int32(60)
	bad := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm-ttl"}, Spec: v1alpha1.ImagePrePullSpec{Images: []string{"x"},
		CompletionPolicy: v1alpha1.CompletionKeepNewNodes, RolloutSpec: v1alpha1.RolloutSpec{TTLSecondsAfterFinished: &ttl}}}
	if err := cl.Create(ctx, bad); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "ttlSecondsAfterFinished does not apply") {
		t.Errorf("KeepNewNodes with a TTL: %v", err)
	}
	bad = &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm-taint"}, Spec: v1alpha1.ImagePrePullSpec{Images: []string{"x"},
		ReadinessTaint: "example.com/warm"}}
	if err := cl.Create(ctx, bad); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "readinessTaint goes with completionPolicy KeepNewNodes") {
		t.Errorf("Once with a readiness taint: %v", err)
	}

	// A node joins: warmed by a rollout of its own, then untainted.
	agents("hollow-b", 2, "--node-labels", "pool=warm")
	st = waitStatus(t, cl, o, "node 2 warmed", func(st v1alpha1.RolloutStatus) bool { return st.Succeeded == 3 })
	if st.Desired != 3 || st.Joined != 1 || st.Failed != 0 || st.Progress != "3/3" {
		t.Errorf("after a join: status %+v", st)
	}
	waitTaint(t, cs, name(2), taint, false)
	joinID := controller.JoinRolloutID(st.RolloutID, name(2), nodeUID(t, cs, name(2)))
	if pulls, err := pullResultsPerNode(ctx, b, 0, joinID); err != nil || pulls[name(2)] != 1 || len(pulls) != 1 {
		t.Errorf("pull results of %s: %v (%v)", joinID, pulls, err)
	}

	// A node whose pulls fail (no puller answers) keeps its taint; a node the selector leaves out is not
	// warmed and keeps its taint.
	agents("hollow-c", 3, "--node-labels", "pool=warm", "--workers", "heartbeat")
	agents("hollow-d", 4, "--node-labels", "pool=cold")
	st = waitStatus(t, cl, o, "node 3 failed", func(st v1alpha1.RolloutStatus) bool { return st.Failed == 1 })
	if st.Desired != 4 || st.Joined != 2 || st.Succeeded != 3 ||
		!slices.Equal(st.FailedNodes, []v1alpha1.NodeFailure{{Node: name(3), Reason: "no answer within the node timeout 3s"}}) {
		t.Errorf("after a failed join: status %+v", st)
	}
	reasons := objectEvents(t, kc, o.Name, "NodeFailed")
	if !slices.Contains(reasons, "NodeJoined") {
		t.Errorf("events %v", reasons)
	}

	// A replaced controller reads the joins back: no second pull; the next node to join is warmed.
	ctl.stop(syscall.SIGTERM)
	startController(t, bin, url, kc, "ctl-2")
	agents("hollow-e", 5, "--node-labels", "pool=warm")
	st = waitStatus(t, cl, o, "node 5 warmed", func(st v1alpha1.RolloutStatus) bool { return st.Succeeded == 4 })
	if st.Desired != 5 || st.Joined != 3 || st.Failed != 1 || st.Progress != "5/5" {
		t.Errorf("after a controller restart: status %+v", st)
	}
	waitTaint(t, cs, name(5), taint, false)
	agents("hollow-f", 6, "--node-labels", "pool=cold") // named: warm-named takes it, warm-new does not
	st = waitStatus(t, cl, named, "node 6 warmed", func(st v1alpha1.RolloutStatus) bool { return st.Succeeded == 2 })
	if st.Desired != 2 || st.Joined != 1 || st.Failed != 0 {
		t.Errorf("warm-named after node 6 joined: status %+v", st)
	}
	waitTaint(t, cs, name(6), taint, false)
	if pulls, err := pullResultsPerNode(ctx, b, 0, joinID); err != nil || pulls[name(2)] != 1 {
		t.Errorf("pull results of %s after the restart: %v (%v)", joinID, pulls, err)
	}
	for _, i := range []int{3, 4} { // the failed node and the one left out
		n, err := cs.CoreV1().Nodes().Get(ctx, name(i), metav1.GetOptions{})
		if err != nil || !hasTaint(n, taint) {
			t.Errorf("node %s: taints %v (%v), want %s kept", name(i), n.Spec.Taints, err, taint)
		}
	}
	if c, r, err := rolloutRecordsPerNode(ctx, b, controller.JoinRolloutID(st.RolloutID, name(4), nodeUID(t, cs, name(4)))); err != nil || len(c)+len(r) != 0 {
		t.Errorf("the node left out was acted on: claims %v, outcomes %v (%v)", c, r, err)
	}
}

// registerNode creates a Node object as a kubelet with --register-with-taints would register it.
func registerNode(t *testing.T, cs kubernetes.Interface, name, taint string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{
		{Key: "example.com/other", Value: "kept", Effect: corev1.TaintEffectPreferNoSchedule},
		{Key: taint, Effect: corev1.TaintEffectNoSchedule}}}}
	if _, err := cs.CoreV1().Nodes().Create(t.Context(), n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// nodeUID is the UID of the Node of name: a join rollout's id holds it.
func nodeUID(t *testing.T, cs kubernetes.Interface, name string) types.UID {
	t.Helper()
	n, err := cs.CoreV1().Nodes().Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.UID
}

func hasTaint(n *corev1.Node, key string) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
}

// waitTaint waits until node has (or, present false, has not) the taint key, and checks that its other taint
// is kept.
func waitTaint(t *testing.T, cs kubernetes.Interface, node, key string, present bool) {
	t.Helper()
	bustest.Eventually(t, fmt.Sprintf("taint %s on %s: %t", key, node, present), time.Minute, func() error {
		n, err := cs.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if hasTaint(n, key) != present {
			return fmt.Errorf("taints %v", n.Spec.Taints)
		}
		if !hasTaint(n, "example.com/other") {
			t.Fatalf("node %s lost its other taint: %v", node, n.Spec.Taints)
		}
		return nil
	})
}

// waitStatus waits until the status of o (an ImagePrePull or an ImageGC) passes ok and returns it.
func waitStatus(t *testing.T, cl client.Client, o client.Object, what string, ok func(v1alpha1.RolloutStatus) bool) v1alpha1.RolloutStatus {
	t.Helper()
	status := func() v1alpha1.RolloutStatus {
		switch o := o.(type) {
		case *v1alpha1.ImagePrePull:
			return o.Status
		case *v1alpha1.ImageGC:
			return o.Status
		}
		t.Fatalf("waitStatus: %T has no rollout status", o)
		return v1alpha1.RolloutStatus{}
	}
	bustest.Eventually(t, o.GetName()+": "+what, time.Minute, func() error {
		if err := cl.Get(t.Context(), client.ObjectKeyFromObject(o), o); err != nil {
			return err
		}
		if st := status(); !ok(st) {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
	return status()
}
