package podindex

import (
	"reflect"
	"sort"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The fixtures of pkg/kubelet/pod/pod_manager_test.go (kubelet v1.36.3).
const (
	mirrorPodUID  = "mirror-pod-uid"
	staticPodUID  = "static-pod-uid"
	normalPodUID  = "normal-pod-uid"
	mirrorPodName = "mirror-static-pod-name"
	staticPodName = "mirror-static-pod-name"
	normalPodName = "normal-pod-name"
)

func fixtures() (mirrorPod, staticPod, normalPod *v1.Pod) {
	mirrorPod = &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		UID: mirrorPodUID, Name: mirrorPodName, Namespace: metav1.NamespaceDefault,
		Annotations: map[string]string{
			ConfigSourceAnnotationKey: "api",
			ConfigMirrorAnnotationKey: "mirror",
			ConfigHashAnnotationKey:   "mirror",
		},
	}}
	staticPod = &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		UID: staticPodUID, Name: staticPodName, Namespace: metav1.NamespaceDefault,
		Annotations: map[string]string{ConfigSourceAnnotationKey: "file"},
	}}
	normalPod = &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		UID: normalPodUID, Name: normalPodName, Namespace: metav1.NamespaceDefault,
		Annotations: map[string]string{},
	}}
	return mirrorPod, staticPod, normalPod
}

func byName(pods []*v1.Pod) []*v1.Pod {
	out := append([]*v1.Pod(nil), pods...)
	sort.Slice(out, func(i, j int) bool {
		if out[i].Name != out[j].Name {
			return out[i].Name < out[j].Name
		}
		return out[i].UID < out[j].UID
	})
	return out
}

func TestAddOrUpdatePod(t *testing.T) {
	mirrorPod, staticPod, normalPod := fixtures()
	tests := []struct {
		name     string
		isMirror bool
		pod      *v1.Pod
	}{
		{name: "mirror pod", pod: mirrorPod, isMirror: true},
		{name: "static pod", pod: staticPod},
		{name: "normal pod", pod: normalPod},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := newIndex()
			verify := func(want *v1.Pod) {
				t.Helper()
				fullName := PodFullName(want)
				if tc.isMirror {
					got, ok := ix.getMirrorPodByUID(want.UID)
					if !ok || got != want {
						t.Fatalf("mirror pod by UID = %v, %v; want the same object", got, ok)
					}
					if got, ok := ix.mirrorByFullNameLocked(fullName); !ok || got != want {
						t.Fatalf("mirror pod by full name = %v, %v", got, ok)
					}
					if _, ok := ix.getPodByUID(want.UID); ok {
						t.Fatal("a mirror pod is in the non-mirror pods")
					}
					return
				}
				if got, ok := ix.getPodByUID(want.UID); !ok || got != want {
					t.Fatalf("pod by UID = %v, %v; want the same object", got, ok)
				}
				if got, ok := ix.GetPodByFullName(fullName); !ok || got != want {
					t.Fatalf("pod by full name = %v, %v", got, ok)
				}
				if _, ok := ix.getMirrorPodByUID(want.UID); ok {
					t.Fatal("a non-mirror pod is in the mirror pods")
				}
			}
			pod := tc.pod.DeepCopy()
			ix.addPod(pod)
			verify(pod)

			updated := pod.DeepCopy()
			updated.Annotations["testLabel"] = "updated"
			ix.updatePod(updated)
			verify(updated)
		})
	}
}

func TestGetSetPods(t *testing.T) {
	mirrorPod, staticPod, normalPod := fixtures()
	wantPodToMirror := map[types.UID]types.UID{staticPodUID: mirrorPodUID}
	wantMirrorToPod := map[types.UID]types.UID{mirrorPodUID: staticPodUID}
	tests := []struct {
		name           string
		podList        []*v1.Pod
		wantUID        types.UID
		wantPod        *v1.Pod
		isMirror       bool
		expectPods     []*v1.Pod
		expectedGetPod *v1.Pod // what getPodByMirrorPod / the lookups return
		wantMirror     *v1.Pod
		wantHasMirror  bool
	}{
		{
			name: "Get normal pod", podList: []*v1.Pod{mirrorPod, staticPod, normalPod},
			wantUID: normalPodUID, wantPod: normalPod, expectPods: []*v1.Pod{staticPod, normalPod},
			expectedGetPod: normalPod, wantMirror: nil, wantHasMirror: false,
		},
		{
			name: "Get static pod", podList: []*v1.Pod{mirrorPod, staticPod, normalPod},
			wantUID: staticPodUID, wantPod: staticPod, expectPods: []*v1.Pod{staticPod, normalPod},
			expectedGetPod: staticPod, wantMirror: mirrorPod, wantHasMirror: true,
		},
		{
			name: "Get mirror pod", podList: []*v1.Pod{mirrorPod, staticPod, normalPod},
			wantUID: staticPodUID, wantPod: mirrorPod, isMirror: true, expectPods: []*v1.Pod{staticPod, normalPod},
			expectedGetPod: staticPod, wantMirror: mirrorPod, wantHasMirror: true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := newIndex()
			ix.setPods(tc.podList)
			if got := byName(ix.getPods()); !reflect.DeepEqual(got, byName(tc.expectPods)) {
				t.Fatalf("getPods = %v, want %v", names(got), names(tc.expectPods))
			}
			if got := ix.translatePodUID(tc.wantPod.UID); got != tc.wantUID {
				t.Errorf("translatePodUID(%s) = %q, want %q", tc.wantPod.UID, got, tc.wantUID)
			}
			fullName := PodFullName(tc.wantPod)
			if p, ok := ix.GetPodByFullName(fullName); !ok || p != tc.expectedGetPod {
				t.Errorf("GetPodByFullName(%s) = %v, %v", fullName, name(p), ok)
			}
			if p, ok := ix.getPodByName(tc.wantPod.Namespace, tc.wantPod.Name); !ok || p != tc.expectedGetPod {
				t.Errorf("getPodByName = %v, %v", name(p), ok)
			}
			if p, ok := ix.getPodByUID(tc.wantUID); !ok || p != tc.expectedGetPod {
				t.Errorf("getPodByUID(%s) = %v, %v", tc.wantUID, name(p), ok)
			}
			podToMirror, mirrorToPod := ix.GetUIDTranslations()
			if !reflect.DeepEqual(podToMirror, wantPodToMirror) || !reflect.DeepEqual(mirrorToPod, wantMirrorToPod) {
				t.Errorf("GetUIDTranslations = %v, %v", podToMirror, mirrorToPod)
			}
			m, ok := ix.getMirrorPodByPod(tc.wantPod)
			if ok != tc.wantHasMirror || m != tc.wantMirror {
				t.Errorf("getMirrorPodByPod = %v, %v; want %v, %v", name(m), ok, name(tc.wantMirror), tc.wantHasMirror)
			}
			pod, mirror, wasMirror := ix.getPodAndMirrorPod(tc.wantPod)
			if pod != tc.expectedGetPod || mirror != tc.wantMirror || wasMirror != tc.isMirror {
				t.Errorf("getPodAndMirrorPod = %v, %v, %v", name(pod), name(mirror), wasMirror)
			}
			// As the kubelet's test: isMirrorPodOf(wantPod, mirrorPod) is true only for the mirror pod itself.
			if got := isMirrorPodOf(tc.wantPod, mirrorPod); got != tc.isMirror {
				t.Errorf("isMirrorPodOf(%s, mirror) = %v, want %v", tc.wantPod.UID, got, tc.isMirror)
			}
			if tc.isMirror {
				if p, ok := ix.getPodByMirrorPod(tc.wantPod); !ok || p != tc.expectedGetPod {
					t.Errorf("getPodByMirrorPod = %v, %v; want the static pod", name(p), ok)
				}
			}
		})
	}
}

func TestRemovePods(t *testing.T) {
	mirrorPod, staticPod, normalPod := fixtures()
	tests := []struct {
		name                     string
		remove                   *v1.Pod
		wantPods, wantMirrorPods []*v1.Pod
		wantOrphans              []string
	}{
		{name: "remove mirror pod", remove: mirrorPod, wantPods: []*v1.Pod{normalPod, staticPod}, wantMirrorPods: []*v1.Pod{}},
		{name: "remove static pod", remove: staticPod, wantPods: []*v1.Pod{normalPod}, wantMirrorPods: []*v1.Pod{mirrorPod},
			wantOrphans: []string{"mirror-static-pod-name_default"}},
		{name: "remove normal pod", remove: normalPod, wantPods: []*v1.Pod{staticPod}, wantMirrorPods: []*v1.Pod{mirrorPod}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := newIndex()
			ix.setPods([]*v1.Pod{mirrorPod, staticPod, normalPod})
			ix.removePod(tc.remove)
			pods, mirrors, orphans := ix.GetPodsAndMirrorPods()
			if !reflect.DeepEqual(byName(ix.getPods()), byName(pods)) {
				t.Fatal("getPods differs from the pods of GetPodsAndMirrorPods")
			}
			if !reflect.DeepEqual(byName(pods), byName(tc.wantPods)) {
				t.Errorf("pods = %v, want %v", names(pods), names(tc.wantPods))
			}
			if !reflect.DeepEqual(byName(mirrors), byName(tc.wantMirrorPods)) {
				t.Errorf("mirror pods = %v, want %v", names(mirrors), names(tc.wantMirrorPods))
			}
			if !reflect.DeepEqual(orphans, tc.wantOrphans) {
				t.Errorf("orphans = %#v, want %#v", orphans, tc.wantOrphans)
			}
		})
	}
}

func TestGetStaticPodToMirrorPodMap(t *testing.T) {
	mirrorPod, staticPod, normalPod := fixtures()
	ix := newIndex()
	ix.setPods([]*v1.Pod{mirrorPod, staticPod, normalPod})
	m := ix.getStaticPodToMirrorPodMap()
	if len(m) != 1 {
		t.Fatalf("map has %d entries, want 1", len(m))
	}
	got, ok := m[staticPod]
	if !ok || got == nil || got.UID != mirrorPodUID {
		t.Fatalf("static pod maps to %v, want the mirror pod %s", got, mirrorPodUID)
	}
}

// TestTranslationIndependentOfOrder checks the static/mirror translation for every arrival order, and the
// fixed quirk W-F: removing the static pod drops the translation (the kubelet keeps a stale one).
func TestTranslationIndependentOfOrder(t *testing.T) {
	mirrorPod, staticPod, normalPod := fixtures()
	orders := [][]*v1.Pod{
		{mirrorPod, staticPod, normalPod}, {staticPod, mirrorPod, normalPod}, {normalPod, mirrorPod, staticPod},
	}
	for i, order := range orders {
		ix := newIndex()
		for _, p := range order {
			ix.addPod(p)
		}
		if got := ix.translatePodUID(mirrorPodUID); got != staticPodUID {
			t.Errorf("order %d: translatePodUID(mirror) = %q", i, got)
		}
		ix.removePod(staticPod)
		if got := ix.translatePodUID(mirrorPodUID); got != mirrorPodUID {
			t.Errorf("order %d: after removing the static pod, translatePodUID(mirror) = %q, want the mirror's own UID", i, got)
		}
		p2m, m2p := ix.GetUIDTranslations()
		if len(p2m) != 0 || len(m2p) != 0 {
			t.Errorf("order %d: translations after static pod removal = %v, %v; want none", i, p2m, m2p)
		}
		ix.addPod(staticPod)
		if got := ix.translatePodUID(mirrorPodUID); got != staticPodUID {
			t.Errorf("order %d: after re-adding, translatePodUID(mirror) = %q", i, got)
		}
	}
}

// TestSameFullNameTwoUIDs covers a pod recreated with a new UID before the old one's delete arrives: the full
// name resolves to the newest, and deleting the old one leaves the new one findable (the kubelet loses it).
func TestSameFullNameTwoUIDs(t *testing.T) {
	old := &v1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "old", Name: "web", Namespace: "ns"}}
	cur := &v1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "new", Name: "web", Namespace: "ns"}}
	ix := newIndex()
	ix.addPod(old)
	ix.addPod(cur)
	if p, _ := ix.getPodByName("ns", "web"); p != cur {
		t.Fatalf("by name = %v, want the newest", name(p))
	}
	ix.removePod(old)
	if p, ok := ix.getPodByName("ns", "web"); !ok || p != cur {
		t.Fatalf("after removing the old pod, by name = %v, %v; want the new one", name(p), ok)
	}
	if n, _ := ix.size(); n != 1 {
		t.Fatalf("len = %d", n)
	}
}

func names(pods []*v1.Pod) []string {
	out := make([]string, 0, len(pods))
	for _, p := range pods {
		out = append(out, name(p))
	}
	return out
}

func name(p *v1.Pod) string {
	if p == nil {
		return "<nil>"
	}
	return string(p.UID)
}
