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

// podAnswers is every answer of a pod manager, in a comparable form.
func podAnswers(m interface {
	GetPods() []*v1.Pod
	GetPodsAndMirrorPods() ([]*v1.Pod, []*v1.Pod, []string)
	GetStaticPodToMirrorPodMap() map[*v1.Pod]*v1.Pod
	GetPodByUID(types.UID) (*v1.Pod, bool)
	GetPodByName(string, string) (*v1.Pod, bool)
	GetPodByFullName(string) (*v1.Pod, bool)
	GetMirrorPodByPod(*v1.Pod) (*v1.Pod, bool)
	GetPodByMirrorPod(*v1.Pod) (*v1.Pod, bool)
	GetPodAndMirrorPod(*v1.Pod) (*v1.Pod, *v1.Pod, bool)
}, translate func(types.UID) string, translations func() (map[string]string, map[string]string), probes []*v1.Pod) []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	add("GetPods %v", describeAll(m.GetPods()))
	pods, mirrors, orphans := m.GetPodsAndMirrorPods()
	slices.Sort(orphans)
	add("GetPodsAndMirrorPods %v %v orphaned %v", describeAll(pods), describeAll(mirrors), orphans)
	var static []string
	for p, mp := range m.GetStaticPodToMirrorPodMap() {
		static = append(static, describe(p)+"->"+describe(mp))
	}
	slices.Sort(static)
	add("GetStaticPodToMirrorPodMap %v", static)
	uids := append(slices.Clone(podUIDs), "", "u-none")
	for _, ns := range podNamespaces {
		for _, name := range podNames {
			uids = append(uids, types.UID(ns+"-"+name+"-0"), types.UID(ns+"-"+name+"-1"))
		}
	}
	for _, uid := range uids {
		p, ok := m.GetPodByUID(uid)
		add("GetPodByUID(%s) %s %v", uid, describe(p), ok)
		add("TranslatePodUID(%s) %s", uid, translate(uid))
	}
	toMirror, toPod := translations()
	add("GetUIDTranslations %v %v", toMirror, toPod)
	for _, ns := range podNamespaces {
		for _, name := range podNames {
			p, ok := m.GetPodByName(ns, name)
			add("GetPodByName(%s, %s) %s %v", ns, name, describe(p), ok)
			p, ok = m.GetPodByFullName(name + "_" + ns)
			add("GetPodByFullName(%s_%s) %s %v", name, ns, describe(p), ok)
		}
	}
	for _, probe := range probes {
		mp, ok := m.GetMirrorPodByPod(probe)
		add("GetMirrorPodByPod(%s) %s %v", describe(probe), describe(mp), ok)
		p, ok := m.GetPodByMirrorPod(probe)
		add("GetPodByMirrorPod(%s) %s %v", describe(probe), describe(p), ok)
		p, mp, was := m.GetPodAndMirrorPod(probe)
		add("GetPodAndMirrorPod(%s) %s %s %v", describe(probe), describe(p), describe(mp), was)
	}
	return out
}

func kubeAnswers(m kubepod.Manager, probes []*v1.Pod) []string {
	return podAnswers(m, func(uid types.UID) string { return string(m.TranslatePodUID(uid)) },
		func() (map[string]string, map[string]string) {
			a, b := m.GetUIDTranslations()
			x, y := map[string]string{}, map[string]string{}
			for k, v := range a {
				x[string(k)] = string(v)
			}
			for k, v := range b {
				y[string(k)] = string(v)
			}
			return x, y
		}, probes)
}

func ourAnswers(ix *podindex.Index, probes []*v1.Pod) []string {
	return podAnswers(ix, func(uid types.UID) string { return string(ix.TranslatePodUID(uid)) },
		func() (map[string]string, map[string]string) {
			a, b := ix.GetUIDTranslations()
			x, y := map[string]string{}, map[string]string{}
			for k, v := range a {
				x[string(k)] = string(v)
			}
			for k, v := range b {
				y[string(k)] = string(v)
			}
			return x, y
		}, probes)
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

// TestPodManagerMatchesKubelet drives the kubelet's pod manager (pkg/kubelet/pod NewBasicPodManager) and
// imagefleet's podindex.Index with the same random AddPod / UpdatePod / RemovePod / SetPods calls over a
// few namespaces, names and UIDs (API, static and mirror pods, matching hashes or not) and compares every
// answer after every call: pods by UID and full name, mirror pods, the static-to-mirror map, UID translation
// both ways, orphaned mirror pods.
func TestPodManagerMatchesKubelet(t *testing.T) {
	n := casesFromEnv(t, "KUBELETDIFF_PODMANAGER_CASES", 1000)
	excluded := map[string]int{}
	var compared, calls int
	for seed := range uint64(n) {
		r := rand.New(rand.NewPCG(seed, 3))
		kube := kubepod.NewBasicPodManager()
		ours := podindex.NewIndex()
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
				ours.SetPods(list)
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
				ours.RemovePod(pod)
				history = append(history, "RemovePod "+describe(pod)+" "+annotations(pod))
			default:
				pod = randomPod(r, op)
				if tainted == "" {
					tainted = differenceMet(kube, false, pod)
				}
				if k%2 == 0 {
					kube.AddPod(pod)
					ours.AddPod(pod)
				} else {
					kube.UpdatePod(pod)
					ours.UpdatePod(pod)
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
			probes := []*v1.Pod{randomPod(r, -1), randomPod(r, -1)}
			if pod != nil {
				probes = append(probes, pod)
			}
			want, got := kubeAnswers(kube, probes), ourAnswers(ours, probes)
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
