package controller

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

func TestEffectivePolicyPrecedence(t *testing.T) {
	i32 := func(v int32) *int32 { return &v }
	d := func(v time.Duration) *metav1.Duration { return &metav1.Duration{Duration: v} }
	q := func(s string) *resource.Quantity { v := resource.MustParse(s); return &v }
	pol := func(name string, prio int32, gen int64, spec v1alpha1.ImageGCPolicySpec) *v1alpha1.ImageGCPolicy {
		spec.Priority = prio
		return &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: name, Generation: gen}, Spec: spec}
	}
	for _, tc := range []struct {
		name string
		in   []*v1alpha1.ImageGCPolicy
		want string // the JSON of the effective policy; "null": none
	}{
		{"no policy", nil, `null`},
		{"one policy", []*v1alpha1.ImageGCPolicy{pol("a", 0, 3, v1alpha1.ImageGCPolicySpec{HighThresholdPercent: i32(70), LowThresholdPercent: i32(60),
			CapacityBytes: q("40Mi"), PinnedImages: []string{"busybox"}})},
			`{"sources":[{"name":"a","generation":3}],"highThresholdPercent":70,"lowThresholdPercent":60,"capacityBytes":41943040,"pinned":[{"policy":"a","images":["busybox"]}]}`},
		{"higher priority wins field by field, unset fields fall through", []*v1alpha1.ImageGCPolicy{
			pol("low", 1, 1, v1alpha1.ImageGCPolicySpec{HighThresholdPercent: i32(90), LowThresholdPercent: i32(80), MinAge: d(time.Minute), MaxAge: d(time.Hour)}),
			pol("high", 10, 2, v1alpha1.ImageGCPolicySpec{HighThresholdPercent: i32(50), LowThresholdPercent: i32(40)}),
		}, `{"sources":[{"name":"high","generation":2},{"name":"low","generation":1}],"highThresholdPercent":50,"lowThresholdPercent":40,"minAge":"1m0s","maxAge":"1h0m0s"}`},
		{"a tie goes to the first name", []*v1alpha1.ImageGCPolicy{
			pol("zeta", 5, 1, v1alpha1.ImageGCPolicySpec{CapacityBytes: q("1Gi")}),
			pol("alpha", 5, 1, v1alpha1.ImageGCPolicySpec{CapacityBytes: q("2Gi")}),
		}, `{"sources":[{"name":"alpha","generation":1},{"name":"zeta","generation":1}],"capacityBytes":2147483648}`},
		{"pinned images are unioned, each under the first policy that lists it", []*v1alpha1.ImageGCPolicy{
			pol("b", 0, 1, v1alpha1.ImageGCPolicySpec{PinnedImages: []string{"busybox", "*/pause:*"}}),
			pol("a", 0, 1, v1alpha1.ImageGCPolicySpec{PinnedImages: []string{"*/pause:*", "nginx"}}),
		}, `{"sources":[{"name":"a","generation":1},{"name":"b","generation":1}],"pinned":[{"policy":"a","images":["*/pause:*","nginx"]},{"policy":"b","images":["busybox"]}]}`},
		{"keepLastTags from the first policy that sets it, named after it", []*v1alpha1.ImageGCPolicy{
			pol("b", 3, 1, v1alpha1.ImageGCPolicySpec{KeepLastTags: &v1alpha1.KeepLastTags{Count: 5}}),
			pol("c", 3, 1, v1alpha1.ImageGCPolicySpec{KeepLastTags: &v1alpha1.KeepLastTags{Count: 9}}),
			pol("a", 1, 1, v1alpha1.ImageGCPolicySpec{KeepLastTags: &v1alpha1.KeepLastTags{Count: 2}}),
		}, `{"sources":[{"name":"b","generation":1},{"name":"c","generation":1},{"name":"a","generation":1}],"keepLastTags":{"count":5,"policy":"b"}}`},
		{"keepCopies carries the node's zone", []*v1alpha1.ImageGCPolicy{
			pol("zonal", 0, 1, v1alpha1.ImageGCPolicySpec{KeepCopies: &v1alpha1.KeepCopies{Count: 2, TopologyKey: "zone"}}),
		}, `{"sources":[{"name":"zonal","generation":1}],"keepCopies":{"count":2,"topologyKey":"zone","zone":"z1","policy":"zonal"}}`},
		{"the thresholds are one setting", []*v1alpha1.ImageGCPolicy{
			pol("first", 2, 1, v1alpha1.ImageGCPolicySpec{HighThresholdPercent: i32(60), LowThresholdPercent: i32(50)}),
			pol("second", 1, 1, v1alpha1.ImageGCPolicySpec{HighThresholdPercent: i32(95), LowThresholdPercent: i32(90)}),
		}, `{"sources":[{"name":"first","generation":1},{"name":"second","generation":1}],"highThresholdPercent":60,"lowThresholdPercent":50}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw, err := json.Marshal(effectivePolicy(tc.in, map[string]string{"zone": "z1"}))
			if err != nil {
				t.Fatal(err)
			}
			if string(raw) != tc.want {
				t.Errorf("got  %s\nwant %s", raw, tc.want)
			}
		})
	}
}

func TestCheckPolicy(t *testing.T) {
	zero := resource.MustParse("0")
	for _, tc := range []struct {
		name string
		spec v1alpha1.ImageGCPolicySpec
		want string
	}{
		{"empty", v1alpha1.ImageGCPolicySpec{}, ""},
		{"globs and IDs", v1alpha1.ImageGCPolicySpec{PinnedImages: []string{"*/pause:*", "sha256:" + strings.Repeat("a", 64), "busybox:1"}}, ""},
		{"bad reference", v1alpha1.ImageGCPolicySpec{PinnedImages: []string{"UPPER/Case"}}, `pinnedImages: image "UPPER/Case" is neither a reference nor an image ID`},
		{"zero quota", v1alpha1.ImageGCPolicySpec{CapacityBytes: &zero}, "capacityBytes 0 must be more than 0"},
		{"bad selector", v1alpha1.ImageGCPolicySpec{Nodes: v1alpha1.PolicyNodes{Selector: &metav1.LabelSelector{
			MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "pool", Operator: "Bogus"}}}}}, "nodes.selector: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := checkPolicy(&v1alpha1.ImageGCPolicy{Spec: tc.spec})
			if tc.want == "" {
				if err != nil {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}
