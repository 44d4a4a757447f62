package kubeletdiff

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	podutil "k8s.io/kubernetes/pkg/api/v1/pod"
	"k8s.io/kubernetes/pkg/kubelet/util/manager"
	"sigs.k8s.io/randfill"

	"github.com/imagefleet/imagefleet/services/podindex"
)

// names is the pool every string of a random pod spec is drawn from: few names, so that the same secret or
// configmap is referenced from many places, and "" (which the visitors skip).
var names = []string{"", "a", "b", "c", "d"}

// randomSpec fills a pod spec at random (every volume source, container, env and envFrom field the visitors
// read), with every string from names.
func randomSpec(seed int64) v1.PodSpec {
	f := randfill.NewWithSeed(seed).NilChance(0.6).NumElements(0, 3).MaxDepth(8).Funcs(
		func(s *string, c randfill.Continue) { *s = names[c.Intn(len(names))] },
		func(q *resource.Quantity, c randfill.Continue) { *q = resource.MustParse("1") },
		func(r *runtime.RawExtension, c randfill.Continue) {},
	)
	var spec v1.PodSpec
	f.Fill(&spec)
	return spec
}

func visitAll(visit func(*v1.Pod, func(string) bool) bool, pod *v1.Pod, stopAfter int) ([]string, bool) {
	var got []string
	ok := visit(pod, func(name string) bool {
		got = append(got, name)
		return len(got) != stopAfter
	})
	return got, ok
}

// TestVisitorsMatchKubelet compares imagefleet's VisitPodSecretNames and VisitPodConfigmapNames with
// pkg/api/v1/pod's on random pod specs: every name in the same order (duplicates included), and the same
// early stop when the visitor returns false.
func TestVisitorsMatchKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_POD_CASES", 3000)
	var secrets, configMaps int
	for seed := range int64(n) {
		pod := &v1.Pod{Spec: randomSpec(seed)}
		for _, v := range []struct {
			kind  string
			kube  func(*v1.Pod, func(string) bool) bool
			ours  func(*v1.Pod, func(string) bool) bool
			count *int
		}{
			{"secret", func(p *v1.Pod, f func(string) bool) bool { return podutil.VisitPodSecretNames(p, f) }, podindex.VisitPodSecretNames, &secrets},
			{"configmap", func(p *v1.Pod, f func(string) bool) bool { return podutil.VisitPodConfigmapNames(p, f) }, podindex.VisitPodConfigmapNames, &configMaps},
		} {
			want, _ := visitAll(v.kube, pod, -1)
			got, _ := visitAll(v.ours, pod, -1)
			if !slices.Equal(got, want) {
				t.Fatalf("seed %d: %s names: imagefleet %q, kubelet %q\npod spec: %+v", seed, v.kind, got, want, pod.Spec)
			}
			*v.count += len(want)
			if len(want) == 0 {
				continue
			}
			stop := 1 + int(seed)%len(want)
			want, wantOK := visitAll(v.kube, pod, stop)
			got, gotOK := visitAll(v.ours, pod, stop)
			if !slices.Equal(got, want) || gotOK != wantOK {
				t.Fatalf("seed %d: %s names stopping after %d: imagefleet %q %v, kubelet %q %v", seed, v.kind, stop, got, gotOK, want, wantOK)
			}
		}
	}
	t.Logf("%d pods: %d secret and %d configmap references visited alike", n, secrets, configMaps)
	if secrets < n/2 || configMaps < n/10 {
		t.Errorf("too few references drawn (%d secrets, %d configmaps in %d pods): the generator is broken", secrets, configMaps, n)
	}
}

// countingStore is a manager.Store that only counts references, as the kubelet's objectStore does (an
// object is dropped when its count reaches 0).
type countingStore map[string]int

func (s countingStore) AddReference(namespace, name string, _ types.UID) { s[namespace+"/"+name]++ }
func (s countingStore) DeleteReference(namespace, name string, _ types.UID) {
	k := namespace + "/" + name
	if s[k] > 0 {
		s[k]--
		if s[k] == 0 {
			delete(s, k)
		}
	}
}
func (s countingStore) Get(string, string) (runtime.Object, error) { return nil, nil }

// referenced is how the kubelet's secret and configmap managers list a pod's objects (getSecretNames,
// getConfigMapNames): the visitor's names as a set.
func referenced(visit func(*v1.Pod, podutil.Visitor) bool) func(*v1.Pod) sets.Set[string] {
	return func(pod *v1.Pod) sets.Set[string] {
		out := sets.New[string]()
		visit(pod, func(name string) bool { out.Insert(name); return true })
		return out
	}
}

// TestRefCountsMatchKubelet drives the kubelet's cache-based secret and configmap managers
// (pkg/kubelet/util/manager NewCacheBasedManager over a counting store) and imagefleet's podindex.Registry
// with the same random RegisterPod / UnregisterPod calls (pods that share namespaces, names and UIDs, specs
// that change), and compares every reference count after every call, and the 0 -> 1 and 1 -> 0 transitions
// imagefleet reports with the counts.
func TestRefCountsMatchKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_REF_CASES", 300)
	var calls, maxCount int
	for seed := range uint64(n) {
		r := rand.New(rand.NewPCG(seed, 2))
		secretStore, configMapStore := countingStore{}, countingStore{}
		secrets := manager.NewCacheBasedManager(secretStore, referenced(podutil.VisitPodSecretNames))
		configMaps := manager.NewCacheBasedManager(configMapStore, referenced(podutil.VisitPodConfigmapNames))
		reg := podindex.NewRegistry()
		for op := range 40 {
			pod := &v1.Pod{Spec: randomSpec(int64(seed)*1000 + int64(op))}
			pod.Namespace = pick(r, "ns1", "ns2")
			pod.Name = pick(r, "p", "q")
			pod.UID = types.UID(pick(r, "u1", "u2", "u3"))
			before := counts(reg)
			var tr []podindex.Transition
			if r.IntN(3) == 0 {
				secrets.UnregisterPod(pod)
				configMaps.UnregisterPod(pod)
				tr = reg.UnregisterPod(pod)
			} else {
				secrets.RegisterPod(pod)
				configMaps.RegisterPod(pod)
				tr = reg.RegisterPod(pod)
			}
			calls++
			want := map[string]int{}
			for k, c := range secretStore {
				want["Secret/"+k] = c
				maxCount = max(maxCount, c)
			}
			for k, c := range configMapStore {
				want["ConfigMap/"+k] = c
			}
			got := counts(reg)
			if !mapsEqual(got, want) {
				t.Fatalf("seed %d op %d: counts differ\nimagefleet: %v\nkubelet:    %v", seed, op, got, want)
			}
			for k := range want {
				kind, ns, name := splitKey(k)
				if c := reg.Count(kind, ns, name); c != want[k] {
					t.Fatalf("seed %d op %d: Count(%s) = %d, kubelet %d", seed, op, k, c, want[k])
				}
			}
			if err := checkTransitions(tr, before, got); err != nil {
				t.Fatalf("seed %d op %d: %v", seed, op, err)
			}
		}
	}
	t.Logf("%d sequences, %d register/unregister calls: counts equal after each (highest count %d)", n, calls, maxCount)
}

func counts(reg *podindex.Registry) map[string]int {
	out := map[string]int{}
	for _, ref := range reg.Refs() {
		out[ref.Kind+"/"+ref.Namespace+"/"+ref.Name] = ref.Count
	}
	return out
}

func splitKey(k string) (kind, ns, name string) {
	p := strings.SplitN(k, "/", 3)
	return p[0], p[1], p[2]
}

func mapsEqual[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// checkTransitions checks that the transitions are exactly the objects whose count went 0 -> 1 or 1 -> 0.
func checkTransitions(tr []podindex.Transition, before, after map[string]int) error {
	want := map[string]bool{}
	for k := range before {
		if after[k] == 0 {
			want[k+" 1->0"] = true
		}
	}
	for k := range after {
		if before[k] == 0 {
			want[k+" 0->1"] = true
		}
	}
	got := map[string]bool{}
	for _, x := range tr {
		s := fmt.Sprintf("%s/%s/%s ", x.Kind, x.Namespace, x.Name)
		if x.Registered {
			s += "0->1"
		} else {
			s += "1->0"
		}
		got[s] = true
	}
	if !mapsEqual(got, want) {
		return fmt.Errorf("transitions %v, counts say %v", sortedKeys(got), sortedKeys(want))
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
