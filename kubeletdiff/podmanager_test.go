package kubeletdiff

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubepod "k8s.io/kubernetes/pkg/kubelet/pod"
	kubetypes "k8s.io/kubernetes/pkg/kubelet/types"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/podindex"
)

// The named, intended differences of imagefleet's pod index from the kubelet's pod manager (documented on
// podindex.Index). After a call that meets one of them the two may answer differently until the next
// SetPods, which rebuilds both from the same pods; the test stops comparing the sequence until then.
const (
	// diffStaticRemovalDropsTranslation is W-F: the kubelet keeps mirror -> static in its translation after
	// the static pod is removed; imagefleet drops it.
	diffStaticRemovalDropsTranslation = "removing a static pod drops its translation (W-F)"
	// diffRemoveOtherFullName: the kubelet's RemovePod deletes the full-name entry whichever pod it points
	// to; imagefleet keeps a newer pod of that full name findable.
	diffRemoveOtherFullName = "removing a pod keeps another pod of its full name findable"
	// diffUpsertRenamed: a UID upserted again under another namespace or name (or switching between mirror and
	// non-mirror) leaves its old full name in imagefleet; the kubelet keeps the old entry pointing at it.
	diffUpsertRenamed = "a pod upserted under another full name leaves its old one"
	// diffSharedFullName: while two pods, or two mirror pods, share a full name, imagefleet derives the
	// translation from the live pods (every mirror of the full name translates to the pod found by that
	// name), whatever the order of their upserts; the kubelet's translation depends on that order (a mirror
	// upserted before the pod gets none, while one after it does). The index promises the kubelet's answers
	// only while at most one pod and one mirror pod share a full name.
	diffSharedFullName = "two pods or two mirror pods share a full name"
)

// sharedFullName reports whether two pods, or two mirror pods, of the kubelet's manager share a full name.
func sharedFullName(m kubepod.Manager) bool {
	pods, mirrors, _ := m.GetPodsAndMirrorPods()
	for _, list := range [][]*v1.Pod{pods, mirrors} {
		seen := map[string]bool{}
		for _, p := range list {
			if seen[fullName(p)] {
				return true
			}
			seen[fullName(p)] = true
		}
	}
	return false
}

var (
	podNamespaces = []string{"ns1", "ns2"}
	podNames      = []string{"p", "q", "r"}
	podUIDs       = []types.UID{"u1", "u2", "u3", "u4", "u5", "u6"}
)

// randomPod draws a pod: an API pod, a static pod (config.source file, config.hash h1 or h2) or a mirror pod
// (config.mirror h1 or h2), with a resource version that tells versions apart.
func randomPod(r *rand.Rand, version int) *v1.Pod {
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: pick(r, podNamespaces...), Name: pick(r, podNames...), UID: pick(r, podUIDs...),
		ResourceVersion: fmt.Sprint(version), Annotations: map[string]string{},
	}}
	kind := r.IntN(3)
	if r.IntN(8) != 0 {
		// Mostly one UID per full name and kind, as a real node has; else any UID, so that UIDs move
		// between names and kinds too.
		p.UID = types.UID(fmt.Sprintf("%s-%s-%d", p.Namespace, p.Name, kind/2)) // pod or mirror pod
	}
	switch kind {
	case 0:
		p.Annotations[podindex.ConfigSourceAnnotationKey] = pick(r, podindex.ApiserverSource, "")
		if p.Annotations[podindex.ConfigSourceAnnotationKey] == "" {
			delete(p.Annotations, podindex.ConfigSourceAnnotationKey)
		}
	case 1:
		p.Annotations[podindex.ConfigSourceAnnotationKey] = pick(r, podindex.FileSource, "http")
		p.Annotations[podindex.ConfigHashAnnotationKey] = pick(r, "h1", "h2")
	default:
		p.Annotations[podindex.ConfigSourceAnnotationKey] = podindex.ApiserverSource
		p.Annotations[podindex.ConfigMirrorAnnotationKey] = pick(r, "h1", "h2")
	}
	return p
}

func describe(p *v1.Pod) string {
	if p == nil {
		return "<nil>"
	}
	return fmt.Sprintf("%s/%s/%s@%s", p.Namespace, p.Name, p.UID, p.ResourceVersion)
}

func describeAll(ps []*v1.Pod) []string {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		out = append(out, describe(p))
	}
	slices.Sort(out)
	return out
}

// kubeAnswers is every answer of the kubelet's pod manager that imagefleet's index exports
// (GetPodsAndMirrorPods, GetPodByFullName for every full name, GetUIDTranslations, which holds TranslatePodUID
// and the static-to-mirror map), in a comparable form.
func kubeAnswers(m kubepod.Manager) []string {
	toMirror, toPod := m.GetUIDTranslations()
	x, y := map[string]string{}, map[string]string{}
	for k, v := range toMirror {
		x[string(k)] = string(v)
	}
	for k, v := range toPod {
		y[string(k)] = string(v)
	}
	pods, mirrors, orphans := m.GetPodsAndMirrorPods()
	return answers(pods, mirrors, orphans, m.GetPodByFullName, x, y)
}

func ourAnswers(ix *podindex.Index) []string {
	toMirror, toPod := ix.GetUIDTranslations()
	x, y := map[string]string{}, map[string]string{}
	for k, v := range toMirror {
		x[string(k)] = string(v)
	}
	for k, v := range toPod {
		y[string(k)] = string(v)
	}
	pods, mirrors, orphans := ix.GetPodsAndMirrorPods()
	return answers(pods, mirrors, orphans, ix.GetPodByFullName, x, y)
}

func answers(pods, mirrors []*v1.Pod, orphans []string, byFullName func(string) (*v1.Pod, bool), toMirror, toPod map[string]string) []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	slices.Sort(orphans)
	add("GetPodsAndMirrorPods %v %v orphaned %v", describeAll(pods), describeAll(mirrors), orphans)
	for _, ns := range podNamespaces {
		for _, name := range podNames {
			p, ok := byFullName(name + "_" + ns)
			add("GetPodByFullName(%s_%s) %s %v", name, ns, describe(p), ok)
		}
	}
	add("GetUIDTranslations %v %v", toMirror, toPod)
	return out
}

func fullName(p *v1.Pod) string { return p.Name + "_" + p.Namespace }

// differenceMet names the intended difference that the call op(pod) on the kubelet's manager m meets, if
// any, from the manager's answers before the call.
func differenceMet(m kubepod.Manager, remove bool, pod *v1.Pod) string {
	mirror := podindex.IsMirrorPod(pod)
	pods, mirrors, _ := m.GetPodsAndMirrorPods()
	if remove {
		if !mirror {
			if toMirror, _ := m.GetUIDTranslations(); toMirror[kubeResolved(pod.UID)] != "" {
				return diffStaticRemovalDropsTranslation
			}
		}
		holder, ok := m.GetPodByFullName(fullName(pod))
		if mirror {
			holder, ok = m.GetMirrorPodByPod(pod)
		}
		if ok && holder.UID != pod.UID {
			return diffRemoveOtherFullName
		}
		for _, p := range append(pods, mirrors...) {
			if p.UID == pod.UID && (fullName(p) != fullName(pod) || podindex.IsMirrorPod(p) != mirror) {
				return diffUpsertRenamed
			}
		}
		return ""
	}
	for _, p := range append(pods, mirrors...) {
		if p.UID == pod.UID && (fullName(p) != fullName(pod) || podindex.IsMirrorPod(p) != mirror) {
			return diffUpsertRenamed
		}
	}
	return ""
}

// TestPodManagerMatchesKubelet drives the kubelet's pod manager (pkg/kubelet/pod NewBasicPodManager) with
// random AddPod / UpdatePod / RemovePod / SetPods calls over a few namespaces, names and UIDs (API, static and
// mirror pods, matching hashes or not), and imagefleet's pod index with the same pods as pod events through
// podindex.State.Apply (added, updated, deleted; SetPods as a new state with each pod added), and compares
// every answer the index exports after every call: pods and mirror pods (so pods by UID), orphaned mirror
// pods, pods by full name, the UID translation both ways (so TranslatePodUID and the static-to-mirror map).
func TestPodManagerMatchesKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_PODMANAGER_CASES", 1000)
	excluded := map[string]int{}
	var compared, calls int
	for seed := range uint64(n) {
		r := rand.New(rand.NewPCG(seed, 3))
		kube := kubepod.NewBasicPodManager()
		ours := podindex.NewState()
		var seq uint64
		apply := func(action string, pod *v1.Pod) {
			seq++
			ours.Apply(seq, podindex.PodEvent{Action: action, Pod: pod})
		}
		tainted := ""
		var history []string
		for op := range 30 {
			calls++
			var pod *v1.Pod
			switch k := r.IntN(10); {
			case k == 0:
				var list []*v1.Pod
				why := ""
				tmp := kubepod.NewBasicPodManager()
				for range r.IntN(5) {
					p := randomPod(r, op)
					if w := differenceMet(tmp, false, p); w != "" && why == "" {
						why = w
					}
					tmp.AddPod(p)
					list = append(list, p)
				}
				kube.SetPods(list)
				ours = podindex.NewState() // SetPods: the index rebuilt from the pods, each added in order
				for _, p := range list {
					apply(events.ActionAdded, p)
				}
				tainted = why
				var desc []string
				for _, p := range list {
					desc = append(desc, describe(p)+" "+annotations(p))
				}
				history = append(history, fmt.Sprintf("SetPods [%s]", strings.Join(desc, "; ")))
			case k <= 3:
				pod = randomPod(r, op)
				if tainted == "" {
					tainted = differenceMet(kube, true, pod)
				}
				kube.RemovePod(pod)
				apply(events.ActionDeleted, pod)
				history = append(history, "RemovePod "+describe(pod)+" "+annotations(pod))
			default:
				pod = randomPod(r, op)
				if tainted == "" {
					tainted = differenceMet(kube, false, pod)
				}
				if k%2 == 0 {
					kube.AddPod(pod)
					apply(events.ActionAdded, pod)
				} else {
					kube.UpdatePod(pod)
					apply(events.ActionUpdated, pod)
				}
				history = append(history, "UpsertPod "+describe(pod)+" "+annotations(pod))
			}
			if tainted == "" && sharedFullName(kube) {
				tainted = diffSharedFullName
			}
			if tainted != "" {
				excluded[tainted]++
				continue
			}
			compared++
			want, got := kubeAnswers(kube), ourAnswers(ours.Index)
			if !slices.Equal(got, want) {
				var diff []string
				for i := range want {
					if i < len(got) && got[i] != want[i] {
						diff = append(diff, "kubelet:    "+want[i], "imagefleet: "+got[i])
					}
				}
				t.Fatalf("seed %d op %d: answers differ\n%s\nhistory:\n  %s", seed, op, strings.Join(diff, "\n"), strings.Join(history, "\n  "))
			}
		}
	}
	t.Logf("%d sequences, %d calls: answers equal after %d; not compared (after a named difference, until SetPods): %v", n, calls, compared, excluded)
	if compared < calls/2 {
		t.Errorf("only %d of %d calls compared: the exclusions hide too much", compared, calls)
	}
}

func annotations(p *v1.Pod) string {
	var kv []string
	for k, v := range p.Annotations {
		kv = append(kv, strings.TrimPrefix(k, "kubernetes.io/")+"="+v)
	}
	slices.Sort(kv)
	return strings.Join(kv, ",")
}

func kubeResolved(uid types.UID) kubetypes.ResolvedPodUID { return kubetypes.ResolvedPodUID(uid) }
