package kubeletdiff

import (
	"fmt"
	"math/rand/v2"
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

	"github.com/imagefleet/imagefleet/events"
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

// TestReferencedNamesMatchKubelet compares, on random pod specs, the secrets and configmaps the kubelet's
// managers reference for a pod (getSecretNames, getConfigMapNames: the names pkg/api/v1/pod's
// VisitPodSecretNames and VisitPodConfigmapNames visit, as a set) with what imagefleet registers for the pod
// when it is added (podindex.State.Apply, then the registry's Refs): the same objects, each counted once,
// and a 0 -> 1 transition for each. (The order of the visits is not observable through the index's API; the
// kubelet's managers use the names as a set.)
func TestReferencedNamesMatchKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_POD_CASES", 3000)
	var secrets, configMaps int
	for seed := range int64(n) {
		pod := &v1.Pod{Spec: randomSpec(seed)}
		pod.Namespace, pod.Name, pod.UID = "ns", "pod", types.UID(fmt.Sprint("uid-", seed))
		want := map[string]int{}
		for name := range referenced(podutil.VisitPodSecretNames)(pod) {
			want["Secret/ns/"+name] = 1
			secrets++
		}
		for name := range referenced(podutil.VisitPodConfigmapNames)(pod) {
			want["ConfigMap/ns/"+name] = 1
			configMaps++
		}
		state := podindex.NewState()
		tr := state.Apply(1, podindex.PodEvent{Action: events.ActionAdded, Pod: pod})
		got := counts(state.Refs)
		if !mapsEqual(got, want) {
			t.Fatalf("seed %d: referenced objects differ\nimagefleet: %v\nkubelet:    %v\npod spec: %+v", seed, sortedKeys(got), sortedKeys(want), pod.Spec)
		}
		if err := checkTransitions(tr, nil, got); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
	t.Logf("%d pods: %d secret and %d configmap references alike", n, secrets, configMaps)
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

// refPods are the pods of the reference-count sequences: a UID names one pod (namespace and name), as the API
// server makes it; two UIDs share a namespace and name (a pod deleted and created again).
var refPods = []struct {
	uid      types.UID
	ns, name string
}{{"u1", "ns1", "p"}, {"u2", "ns1", "q"}, {"u3", "ns2", "p"}, {"u4", "ns1", "p"}}

// TestRefCountsMatchKubelet drives the kubelet's cache-based secret and configmap managers
// (pkg/kubelet/util/manager NewCacheBasedManager over a counting store) with the calls the kubelet makes for
// a pod's life (a pod synced while not terminal: RegisterPod; terminal, SyncTerminatedPod: UnregisterPod;
// deleted: UnregisterPod), and imagefleet with the same pods as pod events through podindex.State.Apply
// (added or updated, in a random phase; deleted), specs changing at random, and compares every reference
// count after every event, and the 0 -> 1 and 1 -> 0 transitions Apply reports with the counts.
func TestRefCountsMatchKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_REF_CASES", 300)
	var calls, maxCount int
	for seed := range uint64(n) {
		r := rand.New(rand.NewPCG(seed, 2))
		secretStore, configMapStore := countingStore{}, countingStore{}
		secrets := manager.NewCacheBasedManager(secretStore, referenced(podutil.VisitPodSecretNames))
		configMaps := manager.NewCacheBasedManager(configMapStore, referenced(podutil.VisitPodConfigmapNames))
		state := podindex.NewState()
		for op := range 40 {
			rp := refPods[r.IntN(len(refPods))]
			pod := &v1.Pod{Spec: randomSpec(int64(seed)*1000 + int64(op))}
			pod.Namespace, pod.Name, pod.UID = rp.ns, rp.name, rp.uid
			if r.IntN(6) == 0 {
				pod.Status.Phase = pick(r, v1.PodSucceeded, v1.PodFailed)
			}
			before := counts(state.Refs)
			action := pick(r, events.ActionAdded, events.ActionUpdated, events.ActionUpdated, events.ActionDeleted)
			switch {
			case action == events.ActionDeleted || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed:
				secrets.UnregisterPod(pod)
				configMaps.UnregisterPod(pod)
			default:
				secrets.RegisterPod(pod)
				configMaps.RegisterPod(pod)
			}
			tr := state.Apply(uint64(op+1), podindex.PodEvent{Action: action, Pod: pod})
			calls++
			want := map[string]int{}
			for k, c := range secretStore {
				want["Secret/"+k] = c
				maxCount = max(maxCount, c)
			}
			for k, c := range configMapStore {
				want["ConfigMap/"+k] = c
			}
			got := counts(state.Refs)
			if !mapsEqual(got, want) {
				t.Fatalf("seed %d op %d (%s %s/%s/%s %s): counts differ\nimagefleet: %v\nkubelet:    %v", seed, op, action, pod.Namespace, pod.Name, pod.UID, pod.Status.Phase, got, want)
			}
			for k := range want {
				kind, ns, name := splitKey(k)
				if c := state.Refs.Count(kind, ns, name); c != want[k] {
					t.Fatalf("seed %d op %d: Count(%s) = %d, kubelet %d", seed, op, k, c, want[k])
				}
			}
			if err := checkTransitions(tr, before, got); err != nil {
				t.Fatalf("seed %d op %d: %v", seed, op, err)
			}
		}
	}
	t.Logf("%d sequences, %d pod events: counts equal after each (highest count %d)", n, calls, maxCount)
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
