package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
)

// TestControllerDeliversImageGCPolicy runs the controller against a real kube-apiserver with the chart's
// CRDs over running hollow agents (zones z0, z1, z0; three 10 MiB images each on a 100 GiB quota): an
// ImageGCPolicy selecting zone z0 with a 40 MiB quota, thresholds 50/30 and app0 pinned reaches the two z0
// agents without a restart; a fleet GC of one of them keeps app0 (pinned by the policy) and frees the other
// two images, down to the policy's low threshold; the z1 node keeps its flags. Editing the policy (app1
// pinned instead) changes the plan on the agents, and so does keepLastTags; deleting it restores the flags. A policy the schema lets
// through but the agents would refuse is InvalidSpec and delivered nowhere; one the schema refuses never
// exists. An invalid edit of a delivered policy keeps its last valid generation in force.
func TestControllerDeliversImageGCPolicy(t *testing.T) {
	const nodes = 3
	kc := kubelab.StartT(t, kubelab.Options{})
	ctx := t.Context()
	cl := controllerClient(t, kc.AdminConfig())
	applyCRDs(t, cl)

	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	h := startHollow(t, bin, "hollow", url, nodes, "--images-per-node", "3", "--zones", "2")
	all, _ := waitReady(t, b, h, "hollow-", nodes, 2*time.Minute)
	z0a, z1, z0b := all[0], all[1], all[2]
	startController(t, bin, url, kc, "ctl-policy")

	i32 := func(v int32) *int32 { return &v }
	quota := resource.MustParse("40Mi")
	pol := &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "keep-app0"}, Spec: v1alpha1.ImageGCPolicySpec{
		Nodes:                v1alpha1.PolicyNodes{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "z0"}}},
		HighThresholdPercent: i32(50), LowThresholdPercent: i32(30), CapacityBytes: &quota,
		PinnedImages: []string{"registry.local/hollow/app0:*"}}}
	if err := cl.Create(ctx, pol); err != nil {
		t.Fatal(err)
	}
	waitPolicyReady(t, cl, pol, 1, 2)
	objectEvents(t, kc, pol.Name, v1alpha1.ReasonApplied)

	// The z0 agents plan with the policy: app0 kept by it, app1 and app2 to go (75 % of 40 MiB, down to 30 %).
	for _, n := range []string{z0a, z0b} {
		res := waitNodePolicy(t, b, n, "keep-app0/1")
		if res.CapacityBytes != 40<<20 || res.UsagePercent != 75 || !slices.Equal(removedTags(res), []string{"app1", "app2"}) ||
			pinnedByGCPolicy(res) != "keep-app0" {
			t.Errorf("%s plan: removed %v, pinned by %q, %+v", n, removedTags(res), pinnedByGCPolicy(res), res)
		}
	}
	// The z1 node keeps its flags.
	if res := nodeDryRun(t, b, z1, false); len(res.Policies) != 0 || res.CapacityBytes != 100<<30 || len(res.Removed) != 0 {
		t.Errorf("%s plan: %+v", z1, res)
	}

	// A fleet GC of one z0 node: the kubelet's policy, as the node's policy now says.
	gcObj := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc-under-policy"},
		Spec: v1alpha1.ImageGCSpec{RolloutSpec: v1alpha1.RolloutSpec{Nodes: v1alpha1.NodeSelection{Names: []string{z0a}}}}}
	if err := cl.Create(ctx, gcObj); err != nil {
		t.Fatal(err)
	}
	st := waitCondition(t, cl, gcObj, v1alpha1.ConditionComplete)
	if st.Succeeded != 1 || st.ImagesRemoved != 2 || st.BytesFreed != 20<<20 {
		t.Errorf("fleet GC under the policy: %+v", st)
	}
	if res := nodeDryRun(t, b, z0a, false); res.UsagePercent != 25 || len(res.Removed) != 0 || policyNamesOf(res) != "keep-app0/1" {
		t.Errorf("%s after the fleet GC: usage %d%%, %+v", z0a, res.UsagePercent, res)
	}

	// Edited: app1 pinned instead of app0; the untouched z0 node plans with generation 2.
	if err := cl.Patch(ctx, pol, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"pinnedImages":["registry.local/hollow/app1:*"]}}`))); err != nil {
		t.Fatal(err)
	}
	waitPolicyReady(t, cl, pol, 2, 2)
	res := waitNodePolicy(t, b, z0b, "keep-app0/2")
	if !slices.Equal(removedTags(res), []string{"app0", "app2"}) || pinnedByGCPolicy(res) != "keep-app0" {
		t.Errorf("%s plan after the edit: removed %v, %+v", z0b, removedTags(res), res)
	}

	// keepLastTags 1: each hollow image is its repository's only tag, so every one is kept (app1 by the pin).
	if err := cl.Patch(ctx, pol, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"keepLastTags":{"count":1}}}`))); err != nil {
		t.Fatal(err)
	}
	waitPolicyReady(t, cl, pol, 3, 2)
	res = waitNodePolicy(t, b, z0b, "keep-app0/3")
	var lastTags []string
	for _, s := range res.Skipped {
		if strings.HasPrefix(s.Why, "kept: one of the last 1 tags of ") && s.Policy == "keep-app0" {
			lastTags = append(lastTags, strings.TrimPrefix(s.Why, "kept: one of the last 1 tags of "))
		}
	}
	slices.Sort(lastTags)
	if len(res.Removed) != 0 || pinnedByGCPolicy(res) != "keep-app0" ||
		!slices.Equal(lastTags, []string{"registry.local/hollow/app0 (policy keep-app0)", "registry.local/hollow/app2 (policy keep-app0)"}) {
		t.Errorf("%s plan with keepLastTags: kept by it %v, %+v", z0b, lastTags, res)
	}

	// An invalid edit (generation 4) keeps generation 3 in force on the nodes: its pins and keepLastTags.
	if err := cl.Patch(ctx, pol, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"pinnedImages":["UPPER/Case"]}}`))); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "keep-app0 InvalidSpec at generation 4", time.Minute, func() error {
		if err := cl.Get(ctx, client.ObjectKeyFromObject(pol), pol); err != nil {
			return err
		}
		c := meta.FindStatusCondition(pol.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Reason != v1alpha1.ReasonInvalidSpec || c.ObservedGeneration != 4 || pol.Status.AppliedGeneration != 3 ||
			pol.Status.MatchedNodes != 2 || !strings.Contains(c.Message, "the last valid generation, 3, stays in force") {
			return fmt.Errorf("status %+v", pol.Status)
		}
		return nil
	})
	if res := nodeDryRun(t, b, z0b, false); policyNamesOf(res) != "keep-app0/3" || pinnedByGCPolicy(res) != "keep-app0" {
		t.Errorf("%s plan after the invalid edit: %+v", z0b, res)
	}

	// A schema-valid policy the agents could not parse is InvalidSpec and delivered nowhere.
	bad := &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "bad-pin"}, Spec: v1alpha1.ImageGCPolicySpec{
		Priority: 100, PinnedImages: []string{"UPPER/Case"}}}
	if err := cl.Create(ctx, bad); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "bad-pin InvalidSpec", time.Minute, func() error {
		if err := cl.Get(ctx, client.ObjectKeyFromObject(bad), bad); err != nil {
			return err
		}
		c := meta.FindStatusCondition(bad.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonInvalidSpec || !strings.Contains(c.Message, `"UPPER/Case"`) {
			return fmt.Errorf("conditions %+v", bad.Status.Conditions)
		}
		return nil
	})
	if res := nodeDryRun(t, b, z1, false); len(res.Policies) != 0 {
		t.Errorf("%s got the invalid policy: %+v", z1, res.Policies)
	}
	// The schema refuses a low threshold at or above the high one, and one threshold alone.
	for spec, want := range map[string]string{
		`{"highThresholdPercent":50,"lowThresholdPercent":50}`: "lowThresholdPercent must be less than highThresholdPercent",
		`{"highThresholdPercent":50}`:                          "highThresholdPercent and lowThresholdPercent are set together",
		`{"capacityBytes":0}`:                                  "capacityBytes must be more than 0",
		`{"capacityBytes":"0Gi"}`:                              "capacityBytes must be more than 0",
	} {
		u := &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "refused"}}
		err := cl.Patch(ctx, u, client.RawPatch(types.ApplyPatchType, []byte(`{"apiVersion":"imagefleet.io/v1alpha1","kind":"ImageGCPolicy","metadata":{"name":"refused"},"spec":`+spec+`}`)),
			client.FieldOwner("test"), client.ForceOwnership)
		if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", spec, err, want)
		}
	}

	// Deleted: the flags again everywhere.
	for _, o := range []client.Object{pol, bad} {
		if err := cl.Delete(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{z0a, z0b} {
		res := waitNodePolicy(t, b, n, "")
		if res.CapacityBytes != 100<<30 || len(res.Removed) != 0 {
			t.Errorf("%s after the delete: %+v", n, res)
		}
	}
	kv, err := b.KVExisting(ctx, events.GCPolicyBucket)
	if err != nil {
		t.Fatal(err)
	}
	if keys, err := kv.List(ctx, ">"); err != nil || len(keys) != 0 {
		t.Errorf("keys left in %s: %d (%v)", events.GCPolicyBucket, len(keys), err)
	}
}

// waitPolicyReady waits until o is Ready for generation gen with matched nodes.
func waitPolicyReady(t *testing.T, cl client.Client, o *v1alpha1.ImageGCPolicy, gen int64, matched int32) {
	t.Helper()
	bustest.Eventually(t, o.Name+" Ready", time.Minute, func() error {
		if err := cl.Get(t.Context(), client.ObjectKeyFromObject(o), o); err != nil {
			return err
		}
		c := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionReady)
		if o.Status.ObservedGeneration != gen || o.Status.MatchedNodes != matched || c == nil || c.Status != metav1.ConditionTrue ||
			c.Reason != v1alpha1.ReasonApplied || c.ObservedGeneration != gen {
			return fmt.Errorf("status %+v", o.Status)
		}
		return nil
	})
}

// nodeDryRun asks node's GC executor for a dry run of the kubelet's pass, or with allUnused of
// DeleteUnusedImages.
func nodeDryRun(t *testing.T, b *bus.Bus, node string, allUnused bool) events.GCResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var res events.GCResult
	if err := b.Request(ctx, events.CommandSubject(node, events.VerbGC), events.GCRequest{DryRun: true, AllUnused: allUnused}, &res); err != nil {
		t.Fatalf("dry run on %s: %v", node, err)
	}
	return res
}

// waitNodePolicy waits until node's dry run applies the policies want ("name/generation,...", "" none).
func waitNodePolicy(t *testing.T, b *bus.Bus, node, want string) events.GCResult {
	t.Helper()
	var res events.GCResult
	bustest.Eventually(t, node+" applies "+want, 2*time.Minute, func() error {
		res = nodeDryRun(t, b, node, false)
		if got := policyNamesOf(res); got != want {
			return fmt.Errorf("applies %q", got)
		}
		return nil
	})
	return res
}

func policyNamesOf(res events.GCResult) string { return events.GCPolicy{Sources: res.Policies}.Names() }

// removedTags are the short names (app<i>) of the images a result removed or would remove, sorted.
func removedTags(res events.GCResult) []string {
	var out []string
	for _, r := range res.Removed {
		for _, tag := range r.RepoTags {
			name, _, _ := strings.Cut(strings.TrimPrefix(tag, "registry.local/hollow/"), ":")
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// pinnedByGCPolicy is the policy named by the result's one image kept by an ImageGCPolicy ("" unless one).
func pinnedByGCPolicy(res events.GCResult) string {
	var names []string
	for _, s := range res.Skipped {
		if s.Why == "pinned by ImageGCPolicy" {
			names = append(names, s.Policy)
		}
	}
	if len(names) != 1 {
		return fmt.Sprint(names)
	}
	return names[0]
}

// TestControllerKeepCopiesAcrossTheFleet runs the controller (with its copies arbiter) and the inventory
// over three hollow agents that each hold the same two images, delivers an ImageGCPolicy with keepCopies 2,
// and runs an AllUnused ImageGC on the three nodes at once: each image is removed from exactly one node, so
// two copies of each remain, although every node found both images unused and asked at the same moment.
func TestControllerKeepCopiesAcrossTheFleet(t *testing.T) {
	const nodes = 3
	kc := kubelab.StartT(t, kubelab.Options{})
	ctx := t.Context()
	cl := controllerClient(t, kc.AdminConfig())
	applyCRDs(t, cl)

	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	h := startHollow(t, bin, "hollow", url, nodes, "--images-per-node", "2")
	all, _ := waitReady(t, b, h, "hollow-", nodes, 2*time.Minute)
	startProc(t, "inventory", bin, "agent", "--node", "inventory", "--workers", "inventory", "--nats", url,
		"--data-dir", t.TempDir(), "--no-journal")
	startController(t, bin, url, kc, "ctl-copies")

	// The images' IDs, and the inventory showing every node holding each.
	plan := nodeDryRun(t, b, all[0], true)
	var ids []string
	for _, r := range plan.Removed {
		ids = append(ids, r.ID)
	}
	if len(ids) != 2 {
		t.Fatalf("images on %s: %+v", all[0], plan)
	}
	holders := func(id string) ([]string, error) {
		kv, err := b.KVExisting(ctx, events.InventoryBucket)
		if err != nil {
			return nil, err
		}
		entries, err := kv.List(ctx, events.InventoryImageKeys(id))
		if err != nil {
			return nil, err
		}
		var out []string
		for _, e := range entries {
			var p events.Placement
			if json.Unmarshal(e.Value, &p) == nil && p.ID == id && !p.Gone {
				out = append(out, p.Node)
			}
		}
		slices.Sort(out)
		return out, nil
	}
	for _, id := range ids {
		bustest.Eventually(t, "the inventory shows "+id+" on every node", time.Minute, func() error {
			h, err := holders(id)
			if err != nil || len(h) != nodes {
				return fmt.Errorf("holders %v (%v)", h, err)
			}
			return nil
		})
	}

	pol := &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "two-copies"}, Spec: v1alpha1.ImageGCPolicySpec{
		KeepCopies: &v1alpha1.KeepCopies{Count: 2}}}
	if err := cl.Create(ctx, pol); err != nil {
		t.Fatal(err)
	}
	waitPolicyReady(t, cl, pol, 1, nodes)
	for _, n := range all {
		waitNodePolicy(t, b, n, "two-copies/1")
	}
	// A dry run asks without recording: every node may remove both (three copies each, two to keep).
	if res := nodeDryRun(t, b, all[1], true); len(res.Removed) != 2 {
		t.Errorf("dry run under keepCopies: %+v", res)
	}

	gcObj := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "all-unused-at-once"}, Spec: v1alpha1.ImageGCSpec{Mode: "AllUnused",
		RolloutSpec: v1alpha1.RolloutSpec{Waves: v1alpha1.Waves{InitialBatch: nodes, MaxInFlight: nodes}}}}
	if err := cl.Create(ctx, gcObj); err != nil {
		t.Fatal(err)
	}
	st := waitCondition(t, cl, gcObj, v1alpha1.ConditionComplete)
	if st.Succeeded != nodes || st.ImagesRemoved != 2 || !slices.Equal(st.Waves, []int32{nodes}) {
		t.Errorf("AllUnused on every node at once under keepCopies 2: %+v", st)
	}
	for _, id := range ids {
		bustest.Eventually(t, "two copies of "+id+" left", time.Minute, func() error {
			h, err := holders(id)
			if err != nil || len(h) != 2 {
				return fmt.Errorf("holders %v (%v)", h, err)
			}
			return nil
		})
	}
}
