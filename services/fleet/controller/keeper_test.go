package controller

import (
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
)

// keepNew is a KeepNewNodes ImagePrePull over every node, Complete.
func keepNew(name, key string) *v1alpha1.ImagePrePull {
	o := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name)},
		Spec: v1alpha1.ImagePrePullSpec{Images: []string{"x"}, CompletionPolicy: v1alpha1.CompletionKeepNewNodes, ReadinessTaint: key}}
	o.Status.RolloutID = "pull-" + name
	meta.SetStatusCondition(&o.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionComplete, Status: metav1.ConditionTrue, Reason: "Done"})
	return o
}

// taintedNode is a Node with the default readiness taint and another one.
func taintedNode(name string, uid types.UID, created time.Time) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, UID: uid, CreationTimestamp: metav1.NewTime(created)},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule},
			{Key: v1alpha1.DefaultReadinessTaint, Effect: corev1.TaintEffectNoSchedule}}}}
}

// testKeeper is a keeper over a fake API server holding objs, its registry synced and showing node n.
func testKeeper(t *testing.T, objs ...client.Object) *keeper {
	t.Helper()
	s, err := Scheme()
	if err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(s).WithObjects(objs...).Build()
	k := newKeeper(t.Context(), Config{Logger: slog.New(slog.DiscardHandler), StatusInterval: time.Second}, nil, prePullKind(), c, c, c.Status(), events.NewFakeRecorder(100))
	k.synced = true
	k.nodes["n"] = registryNode{}
	k.sem = make(chan struct{}) // no join gets to work: the tests look at what was taken on
	t.Cleanup(func() {
		k.stop()
	})
	return k
}

// follow registers o with k as activated with planned as its first rollout's nodes.
func follow(t *testing.T, k *keeper, o *v1alpha1.ImagePrePull, planned map[string]bool) *keptObject {
	t.Helper()
	ko, err := newKeptObject(k.base, o)
	if err != nil {
		t.Fatal(err)
	}
	ko.rolloutID, ko.active, ko.planned, ko.plannedAt = o.Status.RolloutID, true, planned, time.Now()
	k.objs[o.Name] = ko
	t.Cleanup(ko.cancel)
	return ko
}

func hasReadinessTaint(t *testing.T, c client.Client, node string) bool {
	t.Helper()
	n := &corev1.Node{}
	if err := c.Get(t.Context(), client.ObjectKey{Name: node}, n); err != nil {
		t.Fatal(err)
	}
	return hasTaintKey(n.Spec.Taints, v1alpha1.DefaultReadinessTaint)
}

func hasTaintKey(ts []corev1.Taint, key string) bool {
	for _, t := range ts {
		if t.Key == key {
			return true
		}
	}
	return false
}

// After a restart the Node reconciler can run before the ImagePrePull reconciler has handed the keeper
// every object: an object the keeper does not follow yet holds the taint of its key.
func TestReadinessWaitsForEveryObjectOfTheKey(t *testing.T) {
	other := keepNew("b", "example.com/other-key")
	failed := keepNew("b", "")
	meta.SetStatusCondition(&failed.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionFailed, Status: metav1.ConditionTrue, Reason: "Budget"})
	for _, tc := range []struct {
		name     string
		b        *v1alpha1.ImagePrePull // in the cluster besides a
		followed bool                   // the keeper follows b
		keep     bool                   // the taint stays
	}{
		{"an object of the key not followed yet", keepNew("b", ""), false, true},
		{"both followed and warm", keepNew("b", ""), true, false},
		{"an object of another key", other, false, false},
		{"a failed object", failed, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := keepNew("a", "")
			k := testKeeper(t, a, tc.b, taintedNode("n", "node-uid", time.Time{}))
			follow(t, k, a, map[string]bool{"n": true})
			if tc.followed {
				follow(t, k, tc.b, map[string]bool{"n": true})
			}
			reconcileNode(t, k, "n")
			if got := hasReadinessTaint(t, k.c, "n"); got != tc.keep {
				t.Errorf("taint kept: %t, want %t", got, tc.keep)
			}
		})
	}
}

// A Node made after the outcome that warmed its name (a reused name: a new machine) is not warm.
func TestReadinessHoldsANodeMadeAfterItsOutcome(t *testing.T) {
	a := keepNew("a", "")
	k := testKeeper(t, a, taintedNode("n", "new-machine", time.Now()))
	ko := follow(t, k, a, map[string]bool{})
	ko.joins["n"] = &join{done: true, ok: true} // an outcome that names no Node: an earlier machine's
	reconcileNode(t, k, "n")
	if !hasReadinessTaint(t, k.c, "n") {
		t.Error("the taint of a Node made after its name was warmed was removed")
	}
	j := joinOf(k, ko, "n")
	if j == nil || j.done || j.uid != "new-machine" {
		t.Errorf("join %+v: want one at work for the new Node", j)
	}
}

// A paused object takes no node on; it takes the held ones on when it resumes.
func TestPausedObjectHoldsJoins(t *testing.T) {
	o := keepNew("a", "")
	o.Spec.Paused = true
	k := testKeeper(t)
	ko := follow(t, k, o, map[string]bool{})
	k.consider(ko, "n", "")
	k.mu.Lock()
	_, taken := ko.joins["n"]
	k.mu.Unlock()
	if taken {
		t.Error("a paused object took a joining node on")
	}
	resumed := o.DeepCopy()
	resumed.Spec.Paused = false
	k.observe(resumed)
	k.mu.Lock()
	_, taken = ko.joins["n"]
	k.mu.Unlock()
	if !taken {
		t.Error("the object did not take the held node on when it resumed")
	}
}

// A Node made again under a reused name gets a join of its own once an agent started after the Node was
// made shows in the registry; the agent of the machine before does not get it.
func TestReadinessRejoinsAReusedName(t *testing.T) {
	made := time.Now().Truncate(time.Second)
	for _, tc := range []struct {
		name    string
		started time.Time // the registry's agent start
		rejoin  bool
	}{
		{"the new machine's agent", made.Add(time.Second), true},
		{"the machine before's agent", made.Add(-time.Hour), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := keepNew("a", "")
			k := testKeeper(t, a, taintedNode("n", "new", made))
			k.nodes["n"] = registryNode{started: tc.started}
			ko := follow(t, k, a, map[string]bool{})
			old := &join{done: true, ok: true, uid: "old"}
			ko.joins["n"] = old
			reconcileNode(t, k, "n")
			if !hasReadinessTaint(t, k.c, "n") {
				t.Error("the taint of a new Node under a warmed name was removed")
			}
			j := joinOf(k, ko, "n")
			if got := j != old && j.uid == "new" && !j.done; got != tc.rejoin {
				t.Errorf("join %+v: a new one for the Node: %t, want %t", j, got, tc.rejoin)
			}
		})
	}
}

// The registry watch's initial values are not joins: a node written after an object's scan and before the
// watch passed them would be missed, so each activated object scans the registry again at the marker.
func TestRegistryMarkerScansAgain(t *testing.T) {
	k := testKeeper(t)
	k.synced = false
	var scanned []string
	var mu sync.Mutex
	k.scan = func(ko *keptObject) error {
		mu.Lock()
		defer mu.Unlock()
		scanned = append(scanned, ko.name)
		return nil
	}
	follow(t, k, keepNew("active", ""), map[string]bool{})
	follow(t, k, keepNew("loading", ""), nil).active = false // it scans once it has read its first rollout
	k.registryEntry(bus.Entry{}, true)
	k.wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(scanned, []string{"active"}) {
		t.Errorf("scanned again: %v, want [active]", scanned)
	}
}

// A Node that no object took on before is not taken on by the Node reconciler: joins come from the registry
// (a node the registry shows lost is not warmed).
func TestReadinessTakesOnlyAReusedNameOn(t *testing.T) {
	a := keepNew("a", "")
	k := testKeeper(t, a, taintedNode("n", "uid", time.Now()))
	k.nodes["n"] = registryNode{started: time.Now().Add(time.Hour)}
	ko := follow(t, k, a, map[string]bool{})
	reconcileNode(t, k, "n")
	k.mu.Lock()
	defer k.mu.Unlock()
	if j := ko.joins["n"]; j != nil {
		t.Errorf("join %+v of a node never taken on", j)
	}
}

// reconcileNode runs the keeper's Node reconciler for node once.
func reconcileNode(t *testing.T, k *keeper, node string) {
	t.Helper()
	if _, err := k.Reconcile(t.Context(), ctrl.Request{NamespacedName: types.NamespacedName{Name: node}}); err != nil {
		t.Fatal(err)
	}
}

// joinOf is ko's join of node, read under the keeper's lock.
func joinOf(k *keeper, ko *keptObject, node string) *join {
	k.mu.Lock()
	defer k.mu.Unlock()
	return ko.joins[node]
}
