package controller

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/services/gc"
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

func TestCheckMerge(t *testing.T) {
	d := func(v time.Duration) *metav1.Duration { return &metav1.Duration{Duration: v} }
	pol := func(name string, prio int32, minAge, maxAge *metav1.Duration) *v1alpha1.ImageGCPolicy {
		return &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1alpha1.ImageGCPolicySpec{Priority: prio, MinAge: minAge, MaxAge: maxAge}}
	}
	for _, tc := range []struct {
		name     string
		in       []*v1alpha1.ImageGCPolicy
		policies string // the conflict's policies, comma-separated; "": no conflict
	}{
		{"none", nil, ""},
		{"one policy's ages", []*v1alpha1.ImageGCPolicy{pol("a", 0, d(time.Minute), d(time.Hour))}, ""},
		{"ages from two policies in order", []*v1alpha1.ImageGCPolicy{pol("a", 0, d(time.Minute), nil), pol("b", 0, nil, d(time.Hour))}, ""},
		{"maxAge 0s is off", []*v1alpha1.ImageGCPolicy{pol("a", 0, d(time.Hour), nil), pol("b", 0, nil, d(0))}, ""},
		{"minAge above maxAge", []*v1alpha1.ImageGCPolicy{pol("short-max", 1, nil, d(time.Hour)), pol("long-min", 2, d(2*time.Hour), nil)},
			"long-min,short-max"},
		{"equal ages", []*v1alpha1.ImageGCPolicy{pol("a", 0, d(time.Hour), nil), pol("b", 0, nil, d(time.Hour))}, "a,b"},
		{"the winning ages decide", []*v1alpha1.ImageGCPolicy{pol("a", 2, d(time.Minute), nil), pol("b", 1, d(3*time.Hour), d(time.Hour))}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := checkMerge(tc.in)
			got := ""
			if c != nil {
				got = strings.Join(c.policies, ",")
				if c.fields != "minAge/maxAge" || c.err == nil {
					t.Errorf("conflict %+v", c)
				}
			}
			if got != tc.policies {
				t.Errorf("policies %q, want %q", got, tc.policies)
			}
		})
	}
}

// TestCheckMergeAgreesWithTheNode: checkMerge mirrors the rules of services/gc's Config.Validate that two
// settings take part in; over a node whose flags set neither age (0, 0), a merge is refused by one exactly
// when it is refused by the other. Only this test imports the GC worker.
func TestCheckMergeAgreesWithTheNode(t *testing.T) {
	i32 := func(v int32) *int32 { return &v }
	d := func(v time.Duration) *metav1.Duration { return &metav1.Duration{Duration: v} }
	ages := []*metav1.Duration{nil, d(0), d(time.Minute), d(time.Hour), d(2 * time.Hour)}
	thresholds := [][2]*int32{{nil, nil}, {i32(80), i32(70)}, {i32(50), i32(50)}, {i32(40), i32(60)}}
	for _, th := range thresholds {
		for _, minA := range ages {
			for _, maxA := range ages {
				for _, split := range []bool{false, true} {
					a := &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "a"}, Spec: v1alpha1.ImageGCPolicySpec{
						HighThresholdPercent: th[0], LowThresholdPercent: th[1], MinAge: minA, MaxAge: maxA}}
					ps := []*v1alpha1.ImageGCPolicy{a}
					if split { // maxAge from another policy
						a.Spec.MaxAge = nil
						ps = append(ps, &v1alpha1.ImageGCPolicy{ObjectMeta: metav1.ObjectMeta{Name: "b"}, Spec: v1alpha1.ImageGCPolicySpec{MaxAge: maxA}})
					}
					cfg := gc.Config{Node: "n1", Policy: gc.Policy{HighThresholdPercent: 85, LowThresholdPercent: 80}}
					eff := effectivePolicy(ps, nil)
					if eff.HighThresholdPercent != nil {
						cfg.Policy.HighThresholdPercent, cfg.Policy.LowThresholdPercent = *eff.HighThresholdPercent, *eff.LowThresholdPercent
					}
					if eff.MinAge != nil {
						cfg.Policy.MinAge = eff.MinAge.Duration
					}
					if eff.MaxAge != nil {
						cfg.Policy.MaxAge = eff.MaxAge.Duration
					}
					nodeErr, ctlErr := cfg.Validate(), checkMerge(ps)
					if (nodeErr == nil) != (ctlErr == nil) {
						t.Errorf("thresholds %v/%v, minAge %v, maxAge %v (split %v): node %v, controller %+v",
							ptrStr(th[0]), ptrStr(th[1]), ptrStr(minA), ptrStr(maxA), split, nodeErr, ctlErr)
					}
				}
			}
		}
	}
}

func ptrStr[T any](p *T) string {
	if p == nil {
		return "unset"
	}
	return fmt.Sprint(*p)
}
