package controller

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
)

func TestJoinRolloutIDIsAValidRolloutID(t *testing.T) {
	base := "pull-" + "0f8e5a2c-6d1b-4b7e-9a51-3c2d7e8f9a10"
	long := strings.Repeat("n", 253)
	uid := types.UID("6b1f0e2a-9c3d-4e5f-8a7b-1c2d3e4f5a6b")
	a, b := JoinRolloutID(base, "node-a", ""), JoinRolloutID(base, long, "")
	ua, ub := JoinRolloutID(base, "node-a", uid), JoinRolloutID(base, "node-a", "another")
	for _, id := range []string{a, b, ua, ub} {
		if err := events.ValidateRolloutID(id); err != nil {
			t.Errorf("%s: %v", id, err)
		}
		if !strings.HasPrefix(id, base+"-join-") {
			t.Errorf("%s: want the object's rollout id first", id)
		}
	}
	if a == b || a != JoinRolloutID(base, "node-a", "") || ua != JoinRolloutID(base, "node-a", uid) {
		t.Errorf("ids %s, %s: want one per node, the same each time", a, b)
	}
	if ua == a || ua == ub {
		t.Errorf("ids %s, %s, %s: want one per Node of a name", a, ua, ub)
	}
	// Without a UID, the id joins were recorded under before: a controller still reads them back.
	if want := base + "-join-66570ff05a207404"; a != want {
		t.Errorf("id by name only %s, want %s", a, want)
	}
}

func TestNodeIDCovers(t *testing.T) {
	made := time.Date(2026, 11, 28, 9, 0, 0, 0, time.UTC)
	node := nodeID{uid: "new", created: made}
	for _, tc := range []struct {
		name    string
		id      nodeID
		uid     types.UID
		started time.Time
		want    bool
	}{
		{"no Kubernetes Node: the name is all there is", nodeID{}, "old", time.Time{}, true},
		{"recorded for the Node", node, "new", time.Time{}, true},
		{"recorded for the Node before", node, "old", made.Add(time.Hour), false},
		{"by name, started after the Node was made", node, "", made, true},
		{"by name, started before", node, "", made.Add(-time.Second), false},
		{"by name, start unknown", node, "", time.Time{}, false},
	} {
		if got := tc.id.covers(tc.uid, tc.started); got != tc.want {
			t.Errorf("%s: covers = %t", tc.name, got)
		}
	}
}

func TestWithoutTaintKeepsTheOthersInOrder(t *testing.T) {
	ts := []corev1.Taint{{Key: "a", Effect: corev1.TaintEffectNoSchedule}, {Key: v1alpha1.DefaultReadinessTaint, Effect: corev1.TaintEffectNoSchedule},
		{Key: "b", Value: "v", Effect: corev1.TaintEffectNoExecute}}
	got := withoutTaint(ts, v1alpha1.DefaultReadinessTaint)
	if !slices.Equal(got, []corev1.Taint{ts[0], ts[2]}) || len(ts) != 3 {
		t.Errorf("got %v (input now %v)", got, ts)
	}
	if got := withoutTaint(ts, "absent"); !slices.Equal(got, ts) {
		t.Errorf("absent key: %v", got)
	}
}

func TestTaintPatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		rest []corev1.Taint
		want string
	}{
		{"others kept", []corev1.Taint{{Key: "a", Effect: corev1.TaintEffectNoSchedule}},
			`{"metadata":{"resourceVersion":"42"},"spec":{"taints":[{"key":"a","effect":"NoSchedule"}]}}`},
		{"the last one", nil, `{"metadata":{"resourceVersion":"42"},"spec":{"taints":null}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := taintPatch("42", tc.rest)
			if err != nil || string(got) != tc.want {
				t.Errorf("got %s (%v), want %s", got, err, tc.want)
			}
		})
	}
}

func TestKeptObjectSelectsWarmedAndCounts(t *testing.T) {
	warm := labels.Set{"pool": "warm"}
	sel, err := metav1.LabelSelectorAsSelector(&metav1.LabelSelector{MatchLabels: warm})
	if err != nil {
		t.Fatal(err)
	}
	ko := &keptObject{sel: sel, planned: map[string]bool{"p1": true, "p2": false}, baseOK: 1, baseFailed: 1,
		joins:       map[string]*join{"j1": {done: true, ok: true}, "j2": {done: true}, "j3": {}},
		failedNodes: []v1alpha1.NodeFailure{{Node: "p2", Reason: "x"}}}
	for _, tc := range []struct {
		node         string
		n            registryNode
		known        bool
		selects, hot bool
	}{
		{"p1", registryNode{labels: warm}, true, true, true},
		{"p2", registryNode{labels: warm}, true, true, false},
		{"j1", registryNode{labels: warm}, true, true, true},
		{"j2", registryNode{labels: warm}, true, true, false},
		{"j3", registryNode{labels: warm}, true, true, false},
		{"cold", registryNode{labels: labels.Set{"pool": "cold"}}, true, false, false},
		{"unregistered", registryNode{}, false, true, false},
	} {
		if got := ko.selects(tc.node, tc.n, tc.known); got != tc.selects {
			t.Errorf("selects(%s) = %t", tc.node, got)
		}
		if got := ko.warmed(tc.node, nodeID{}); got != tc.hot {
			t.Errorf("warmed(%s) = %t", tc.node, got)
		}
	}
	c := ko.countsLocked()
	if c.Desired != 5 || c.Joined != 3 || c.Active != 1 || c.Succeeded != 2 || c.Failed != 2 || c.Progress != "4/5" || len(c.FailedNodes) != 1 {
		t.Errorf("counts %+v", c)
	}
	named := &keptObject{names: map[string]bool{"a": true}}
	if !named.selects("a", registryNode{}, false) || named.selects("b", registryNode{labels: warm}, true) {
		t.Error("names: want exactly the named nodes")
	}
}

func TestWarmForNeedsEveryObjectOfTheKey(t *testing.T) {
	warm := labels.Set{"pool": "warm"}
	obj := func(name, key string, active bool, planned map[string]bool) *keptObject {
		return &keptObject{name: name, key: key, sel: labels.SelectorFromSet(warm), active: active, planned: planned, joins: map[string]*join{}}
	}
	const key = v1alpha1.DefaultReadinessTaint
	for _, tc := range []struct {
		name   string
		synced bool
		objs   []*keptObject
		want   []string
	}{
		{"the registry not read yet", false, []*keptObject{obj("a", key, true, map[string]bool{"n": true})}, nil},
		{"one object warmed it", true, []*keptObject{obj("a", key, true, map[string]bool{"n": true})}, []string{"a"}},
		{"one of two did not", true, []*keptObject{obj("a", key, true, map[string]bool{"n": true}), obj("b", key, true, map[string]bool{"n": false})}, nil},
		{"one still in its first rollout", true, []*keptObject{obj("b", key, true, map[string]bool{"n": true}), obj("a", key, false, nil)}, nil},
		{"another key's object does not count", true, []*keptObject{obj("b", key, true, map[string]bool{"n": true}), obj("a", "example.com/other", false, nil)}, []string{"b"}},
		{"both warmed it", true, []*keptObject{obj("b", key, true, map[string]bool{"n": true}), obj("a", key, true, map[string]bool{"n": true})}, []string{"a", "b"}},
		{"no object of the key", true, []*keptObject{obj("a", "example.com/other", true, map[string]bool{"n": true})}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := &keeper{synced: tc.synced, nodes: map[string]registryNode{"n": {labels: warm}}, objs: map[string]*keptObject{}}
			for _, ko := range tc.objs {
				k.objs[ko.name] = ko
			}
			by, ok := k.warmFor("n", nodeID{}, key)
			if ok != (tc.want != nil) || !slices.Equal(by, tc.want) {
				t.Errorf("warmFor = %v, %t; want %v", by, ok, tc.want)
			}
		})
	}
}
