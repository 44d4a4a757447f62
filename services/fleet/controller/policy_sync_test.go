package controller

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
)

func policyNodes(names ...string) []events.NodeStatus {
	out := make([]events.NodeStatus, len(names))
	for i, n := range names {
		out[i].Node = n
		out[i].Labels = map[string]string{"pool": "a"}
	}
	return out
}

// nodePolicy decodes node's value in plan.
func nodePolicy(t *testing.T, pl policyPlan, node string) *events.GCPolicy {
	t.Helper()
	raw, ok := pl.want[events.NodeToken(node)]
	if !ok {
		return nil
	}
	var p events.GCPolicy
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatal(err)
	}
	return &p
}

// An invalid edit keeps the last valid generation in force, from memory on the leader that saw it and from
// the status on one that did not; Ready says so.
func TestPlanKeepsTheLastValidGeneration(t *testing.T) {
	v1 := v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "pins", UID: "u1", Generation: 1},
		Spec: v1alpha1.ImageGCPolicySpec{PinnedImages: []string{"registry.local/app0:*"}}}
	v2 := *v1.DeepCopy()
	v2.Generation = 2
	v2.Spec.PinnedImages = []string{"UPPER/Case"}
	nodes := policyNodes("n1")
	check := func(t *testing.T, p *policySync, o v1alpha1.ImageGCPolicy) {
		t.Helper()
		pl, err := p.plan([]v1alpha1.ImageGCPolicy{o}, nodes)
		if err != nil {
			t.Fatal(err)
		}
		got := nodePolicy(t, pl, "n1")
		if got == nil || got.Names() != "pins/1" || len(got.Pinned) != 1 || got.Pinned[0].Images[0] != "registry.local/app0:*" {
			t.Fatalf("n1's policy at generation 2: %+v", got)
		}
		out := pl.outcomes["pins"]
		c := readyCondition(&o, out, nil)
		if c.Reason != v1alpha1.ReasonInvalidSpec || !strings.Contains(c.Message, "the last valid generation, 1, stays in force") ||
			out.applied == nil || out.applied.gen != 1 || out.matched != 1 {
			t.Errorf("outcome %+v, condition %+v", out, c)
		}
	}
	t.Run("the same leader", func(t *testing.T) {
		p := &policySync{applied: map[types.UID]appliedPolicy{}}
		pl, err := p.plan([]v1alpha1.ImageGCPolicy{v1}, nodes)
		if err != nil || nodePolicy(t, pl, "n1").Names() != "pins/1" {
			t.Fatalf("generation 1: %v %+v", err, pl)
		}
		check(t, p, v2)
	})
	t.Run("a new leader", func(t *testing.T) {
		o := *v2.DeepCopy()
		o.Status.AppliedGeneration, o.Status.AppliedSpec = 1, v1.Spec.DeepCopy()
		check(t, &policySync{applied: map[types.UID]appliedPolicy{}}, o)
	})
	t.Run("never valid", func(t *testing.T) {
		p := &policySync{applied: map[types.UID]appliedPolicy{}}
		pl, err := p.plan([]v1alpha1.ImageGCPolicy{v2}, nodes)
		if err != nil {
			t.Fatal(err)
		}
		if got := nodePolicy(t, pl, "n1"); got != nil {
			t.Errorf("n1 got %+v", got)
		}
		if c := readyCondition(&v2, pl.outcomes["pins"], nil); c.Reason != v1alpha1.ReasonInvalidSpec || !strings.Contains(c.Message, "no generation is in force") {
			t.Errorf("condition %+v", c)
		}
	})
	t.Run("recreated under the same name", func(t *testing.T) {
		p := &policySync{applied: map[types.UID]appliedPolicy{}}
		if _, err := p.plan([]v1alpha1.ImageGCPolicy{v1}, nodes); err != nil {
			t.Fatal(err)
		}
		o := *v2.DeepCopy()
		o.UID = "u2"
		pl, err := p.plan([]v1alpha1.ImageGCPolicy{o}, nodes)
		if err != nil || nodePolicy(t, pl, "n1") != nil || len(p.applied) != 0 {
			t.Errorf("n1 got %+v (%v), applied %v", nodePolicy(t, pl, "n1"), err, p.applied)
		}
	})
}

// Two valid policies whose ages merge into minAge >= maxAge: the node's key is held, both policies are
// ConflictingPolicies, and the other nodes get their merge.
func TestPlanHoldsAConflictingMerge(t *testing.T) {
	d := func(v time.Duration) *metav1.Duration { return &metav1.Duration{Duration: v} }
	pol := func(name, uid string, prio int32, pool string, spec v1alpha1.ImageGCPolicySpec) v1alpha1.ImageGCPolicy {
		spec.Priority = prio
		if pool != "" {
			spec.Nodes.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"pool": pool}}
		}
		return v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(uid), Generation: 1}, Spec: spec}
	}
	items := []v1alpha1.ImageGCPolicy{
		pol("long-min", "u1", 10, "", v1alpha1.ImageGCPolicySpec{MinAge: d(2 * time.Hour)}),
		pol("short-max", "u2", 5, "a", v1alpha1.ImageGCPolicySpec{MaxAge: d(time.Hour)}),
	}
	nodes := policyNodes("n1", "n2")
	nodes = append(nodes, events.NodeStatus{NodeInfo: events.NodeInfo{Node: "n3", Labels: map[string]string{"pool": "b"}}})
	p := &policySync{applied: map[types.UID]appliedPolicy{}}
	pl, err := p.plan(items, nodes)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"n1", "n2"} {
		if got := nodePolicy(t, pl, n); got != nil || !pl.hold[events.NodeToken(n)] {
			t.Errorf("%s: written %+v, held %v", n, got, pl.hold[events.NodeToken(n)])
		}
	}
	if got := nodePolicy(t, pl, "n3"); got == nil || got.Names() != "long-min/1" {
		t.Errorf("n3: %+v", got)
	}
	for _, name := range []string{"long-min", "short-max"} {
		o := items[0]
		if name == "short-max" {
			o = items[1]
		}
		c := readyCondition(&o, pl.outcomes[name], nil)
		if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonConflictingPolicies ||
			!strings.Contains(c.Message, "minAge/maxAge") || !strings.Contains(c.Message, "node n1 and 1 other nodes") {
			t.Errorf("%s: %+v", name, c)
		}
	}
}

// Every policyReread-th resync drops written, so the next sync reads the bucket again.
func TestResyncsDropWritten(t *testing.T) {
	p := &policySync{written: map[string][]byte{"k": nil}}
	for i := 1; i < policyReread; i++ {
		p.resynced()
		if p.written == nil {
			t.Fatalf("dropped after %d resyncs", i)
		}
	}
	p.resynced()
	if p.written != nil {
		t.Errorf("kept after %d resyncs", policyReread)
	}
}
