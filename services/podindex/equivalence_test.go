package podindex

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"sort"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// randomPods draws pods from small pools so that UIDs, full names (names holding "_" included, where the
// kubelet's name_namespace keys collide), mirror/static pairs and referenced objects keep meeting.
type randomPods struct {
	r *rand.Rand
}

var (
	eqUIDs       = []types.UID{"u1", "u2", "u3", "u4", "u5", "u6", "u7", "u8"}
	eqNames      = []string{"a", "b", "a_x", "c"}
	eqNamespaces = []string{"x", "ns", "x_ns"}
	eqObjects    = []string{"s1", "s2", "s3", "s4", "", "c1", "c2"}
)

func (g randomPods) pick(list []string) string { return list[g.r.IntN(len(list))] }

func (g randomPods) pod() *v1.Pod {
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		UID: eqUIDs[g.r.IntN(len(eqUIDs))], Name: g.pick(eqNames), Namespace: g.pick(eqNamespaces),
	}}
	switch g.r.IntN(5) {
	case 0: // mirror pod
		p.Annotations = map[string]string{ConfigMirrorAnnotationKey: g.pick([]string{"h1", "h2"}),
			ConfigSourceAnnotationKey: ApiserverSource}
	case 1: // static pod
		p.Annotations = map[string]string{ConfigSourceAnnotationKey: FileSource,
			ConfigHashAnnotationKey: g.pick([]string{"h1", "h2"})}
	case 2:
		p.Annotations = map[string]string{ConfigSourceAnnotationKey: ApiserverSource}
	}
	p.Status.Phase = []v1.PodPhase{v1.PodPending, v1.PodRunning, v1.PodRunning, v1.PodSucceeded, v1.PodFailed}[g.r.IntN(5)]
	for range g.r.IntN(3) {
		p.Spec.ImagePullSecrets = append(p.Spec.ImagePullSecrets, v1.LocalObjectReference{Name: g.pick(eqObjects)})
	}
	for i := range g.r.IntN(3) {
		c := v1.Container{Name: fmt.Sprint("c", i), Image: g.pick([]string{"img:1", "img:2", ""})}
		for range g.r.IntN(3) {
			c.EnvFrom = append(c.EnvFrom,
				v1.EnvFromSource{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}},
				v1.EnvFromSource{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}})
		}
		for range g.r.IntN(3) {
			c.Env = append(c.Env,
				v1.EnvVar{Name: "s", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}}},
				v1.EnvVar{Name: "c", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}}})
		}
		if g.r.IntN(2) == 0 {
			p.Spec.Containers = append(p.Spec.Containers, c)
		} else {
			p.Spec.InitContainers = append(p.Spec.InitContainers, c)
		}
	}
	for i := range g.r.IntN(4) {
		vol := v1.Volume{Name: fmt.Sprint("v", i)}
		switch g.r.IntN(4) {
		case 0:
			vol.Secret = &v1.SecretVolumeSource{SecretName: g.pick(eqObjects)}
		case 1:
			vol.ConfigMap = &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}
		case 2:
			vol.Projected = &v1.ProjectedVolumeSource{Sources: []v1.VolumeProjection{
				{Secret: &v1.SecretProjection{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}},
				{ConfigMap: &v1.ConfigMapProjection{LocalObjectReference: v1.LocalObjectReference{Name: g.pick(eqObjects)}}},
			}}
		default:
			vol.Image = &v1.ImageVolumeSource{Reference: g.pick([]string{"vol:1", "img:1"})}
		}
		p.Spec.Volumes = append(p.Spec.Volumes, vol)
	}
	return p
}

// TestModelEquivalence applies random pod events to the State and to the naive reference model (model_test.go)
// and compares every transition, every index and registry answer, and every
// snapshot delta, after every event. Half the added and updated events come prepared, as from the decoder.
func TestModelEquivalence(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			g := randomPods{rand.New(rand.NewPCG(seed, 7))}
			s, m := NewState(), newMState()
			var applied []*v1.Pod
			var seq uint64 // stream sequences only grow, with gaps (as a stream's do)
			for i := range 600 {
				var ev PodEvent
				switch k := g.r.IntN(10); {
				case k < 3 && len(applied) > 0:
					// Delete a pod seen before, sometimes with a body under another name.
					p := applied[g.r.IntN(len(applied))].DeepCopy()
					if g.r.IntN(4) == 0 {
						p.Name = g.pick(eqNames)
					}
					ev = PodEvent{Action: events.ActionDeleted, Pod: p}
				case k < 4:
					ev = PodEvent{Action: events.ActionDeleted, Pod: g.pod()}
				default:
					p := g.pod()
					ev = PodEvent{Action: []string{events.ActionAdded, events.ActionUpdated}[g.r.IntN(2)], Pod: p}
					if g.r.IntN(2) == 0 {
						ev.Raw = []byte(fmt.Sprintf(`{"metadata":{"uid":%q,"n":%d}}`, p.UID, i))
					}
					if g.r.IntN(2) == 0 {
						ev.prep.set(p) // as DecodePodEvent does; otherwise Apply works it out
					}
					applied = append(applied, p)
				}
				seq++
				if g.r.IntN(20) == 0 {
					seq += 5 // gaps: other nodes' events, or deleted ones
				}
				got, want := s.Apply(seq, ev), m.Apply(seq, ev)
				if len(got)+len(want) > 0 && !reflect.DeepEqual(got, want) {
					t.Fatalf("event %d (%s %s/%s %s): transitions\n got %+v\nwant %+v", i, ev.Action,
						ev.Pod.Namespace, ev.Pod.Name, ev.Pod.UID, got, want)
				}
				compareStates(t, fmt.Sprint("event ", i), s, m)
				switch g.r.IntN(25) {
				case 0:
					compareDirty(t, fmt.Sprint("event ", i), s, m, g.r.IntN(3) == 0)
				case 1:
					seq += 3 // a rejected event
					s.skip(seq)
					m.skip(seq)
				}
			}
		})
	}
}

// TestIndexModelEquivalence drives the in-process Index API (addPod, updatePod, removePod, setPods).
func TestIndexModelEquivalence(t *testing.T) {
	for seed := range uint64(40) {
		g := randomPods{rand.New(rand.NewPCG(seed, 11))}
		ix, mx := newIndex(), newMIndex()
		for i := range 400 {
			switch k := g.r.IntN(20); {
			case k == 0:
				pods := make([]*v1.Pod, g.r.IntN(6))
				for j := range pods {
					pods[j] = g.pod()
				}
				ix.setPods(pods)
				mx.setPods(pods)
			case k < 6:
				p := g.pod()
				ix.removePod(p)
				mx.removePod(p)
			case k < 13:
				p := g.pod()
				ix.addPod(p)
				mx.addPod(p)
			default:
				p := g.pod()
				ix.updatePod(p)
				mx.updatePod(p)
			}
			compareIndexes(t, fmt.Sprintf("seed %d op %d", seed, i), ix, mx)
		}
	}
}

func uidsOf(pods []*v1.Pod) []*v1.Pod {
	out := slices.Clone(pods)
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	return out
}

func compareIndexes(t *testing.T, at string, ix *Index, mx *mIndex) {
	t.Helper()
	fail := func(what string, got, want any) {
		t.Helper()
		t.Fatalf("%s: %s\n got %s\nwant %s", at, what, describe(got), describe(want))
	}
	if gp, gm := ix.size(); true {
		wp, wm := mx.size()
		if gp != wp || gm != wm {
			fail("Len", []int{gp, gm}, []int{wp, wm})
		}
	}
	if got, want := uidsOf(ix.getPods()), uidsOf(mx.getPods()); !reflect.DeepEqual(got, want) {
		fail("getPods", got, want)
	}
	gp, gm, go_ := ix.GetPodsAndMirrorPods()
	wp, wm, wo := mx.GetPodsAndMirrorPods()
	if !reflect.DeepEqual(uidsOf(gp), uidsOf(wp)) || !reflect.DeepEqual(uidsOf(gm), uidsOf(wm)) || !reflect.DeepEqual(go_, wo) {
		fail("GetPodsAndMirrorPods", []any{gp, gm, go_}, []any{wp, wm, wo})
	}
	if got, want := ix.getStaticPodToMirrorPodMap(), mx.getStaticPodToMirrorPodMap(); !reflect.DeepEqual(got, want) {
		fail("getStaticPodToMirrorPodMap", got, want)
	}
	gpm, gmp := ix.GetUIDTranslations()
	wpm, wmp := mx.GetUIDTranslations()
	if !reflect.DeepEqual(gpm, wpm) || !reflect.DeepEqual(gmp, wmp) {
		fail("GetUIDTranslations", []any{gpm, gmp}, []any{wpm, wmp})
	}
	for _, uid := range append(eqUIDs, "", "unknown") {
		g1, g2 := ix.getPodByUID(uid)
		w1, w2 := mx.getPodByUID(uid)
		if g1 != w1 || g2 != w2 {
			fail("getPodByUID "+string(uid), g1, w1)
		}
		g1, g2 = ix.getMirrorPodByUID(uid)
		w1, w2 = mx.getMirrorPodByUID(uid)
		if g1 != w1 || g2 != w2 {
			fail("getMirrorPodByUID "+string(uid), g1, w1)
		}
		if g, w := ix.translatePodUID(uid), mx.translatePodUID(uid); g != w {
			fail("translatePodUID "+string(uid), g, w)
		}
	}
	for _, ns := range eqNamespaces {
		for _, name := range eqNames {
			g1, g2 := ix.getPodByName(ns, name)
			w1, w2 := mx.getPodByName(ns, name)
			if g1 != w1 || g2 != w2 {
				fail("getPodByName "+ns+"/"+name, g1, w1)
			}
			fn := buildPodFullName(name, ns)
			g1, g2 = ix.GetPodByFullName(fn)
			w1, w2 = mx.GetPodByFullName(fn)
			if g1 != w1 || g2 != w2 {
				fail("GetPodByFullName "+fn, g1, w1)
			}
			probe := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
			g1, g2 = ix.getMirrorPodByPod(probe)
			w1, w2 = mx.getMirrorPodByPod(probe)
			if g1 != w1 || g2 != w2 {
				fail("getMirrorPodByPod "+fn, g1, w1)
			}
			g1, g2 = ix.getPodByMirrorPod(probe)
			w1, w2 = mx.getPodByMirrorPod(probe)
			if g1 != w1 || g2 != w2 {
				fail("getPodByMirrorPod "+fn, g1, w1)
			}
			for _, mirror := range []bool{false, true} {
				if mirror {
					probe.Annotations = map[string]string{ConfigMirrorAnnotationKey: "h1"}
				}
				a, b, c := ix.getPodAndMirrorPod(probe)
				x, y, z := mx.getPodAndMirrorPod(probe)
				if a != x || b != y || c != z {
					fail("getPodAndMirrorPod "+fn, []any{a, b, c}, []any{x, y, z})
				}
			}
		}
	}
}

func compareStates(t *testing.T, at string, s *State, m *mState) {
	t.Helper()
	compareIndexes(t, at, s.Index, m.Index)
	if g, w := s.Refs.Refs(), m.Refs.Refs(); !reflect.DeepEqual(g, w) {
		t.Fatalf("%s: Refs\n got %v\nwant %v", at, g, w)
	}
	for _, ns := range eqNamespaces {
		for _, obj := range eqObjects {
			for _, kind := range []string{events.KindSecret, events.KindConfigMap} {
				if g, w := s.Refs.Count(kind, ns, obj), m.Refs.Count(kind, ns, obj); g != w {
					t.Fatalf("%s: Count(%s %s/%s) = %d, want %d", at, kind, ns, obj, g, w)
				}
			}
		}
		for _, name := range eqNames {
			for _, uid := range eqUIDs {
				p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: uid}}
				if g, w := s.Refs.isPodRegistered(p), m.Refs.isPodRegistered(p); g != w {
					t.Fatalf("%s: isPodRegistered(%s/%s %s) = %v, want %v", at, ns, name, uid, g, w)
				}
			}
		}
	}
	if g, w := s.Applied(), m.Applied(); g != w {
		t.Fatalf("%s: Applied = %d, want %d", at, g, w)
	}
	if g, w := s.InUseImages(), m.InUseImages(); !reflect.DeepEqual(g, w) {
		t.Fatalf("%s: InUseImages = %v, want %v", at, g, w)
	}
}

// compareDirty takes the snapshot deltas of both; with fail, both writes "fail" and are marked dirty again.
func compareDirty(t *testing.T, at string, s *State, m *mState, fail bool) {
	t.Helper()
	gd, err := s.takeDirty()
	if err != nil {
		t.Fatal(err)
	}
	wd, err := m.takeDirty()
	if err != nil {
		t.Fatal(err)
	}
	gputs := map[types.UID][]byte{}
	for _, r := range gd.Puts {
		if _, dup := gputs[r.UID]; dup {
			t.Fatalf("%s: takeDirty put %s twice", at, r.UID)
		}
		b, err := r.Encode()
		if err != nil {
			t.Fatal(err)
		}
		gputs[r.UID] = b
	}
	gdel, wdel := slices.Clone(gd.Deletes), slices.Clone(wd.Deletes)
	slices.Sort(gdel)
	slices.Sort(wdel)
	if len(gputs)+len(wd.Puts) > 0 && !reflect.DeepEqual(gputs, wd.Puts) || !slices.Equal(gdel, wdel) || gd.Applied != wd.Applied {
		t.Fatalf("%s: takeDirty\n got puts %d %s deletes %v applied %d\nwant puts %d %s deletes %v applied %d", at,
			len(gputs), dirtyKeys(gputs), gdel, gd.Applied, len(wd.Puts), dirtyKeys(wd.Puts), wdel, wd.Applied)
	}
	if fail {
		s.redirty(gd)
		m.redirty(wd)
	}
}

func dirtyKeys(m map[types.UID][]byte) []string {
	var out []string
	for k, v := range m {
		out = append(out, string(k)+"="+string(v))
	}
	sort.Strings(out)
	return out
}

// TestAppendRefNamesMatchesVisitors checks the one-pass name extraction against visitPodSecretNames and
// visitPodConfigmapNames (the kubelet's walk) on random pods whose volumes set any mix of sources, several
// at once included (the visitors' switches then pick the first).
func TestAppendRefNamesMatchesVisitors(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	name := func() string { return []string{"", "a", "b", "c", "d"}[r.IntN(5)] }
	lref := func() *v1.LocalObjectReference {
		if r.IntN(3) == 0 {
			return nil
		}
		return &v1.LocalObjectReference{Name: name()}
	}
	envs := func() ([]v1.EnvFromSource, []v1.EnvVar) {
		var from []v1.EnvFromSource
		var env []v1.EnvVar
		for range r.IntN(4) {
			var f v1.EnvFromSource
			if r.IntN(2) == 0 {
				f.SecretRef = &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
			}
			if r.IntN(2) == 0 {
				f.ConfigMapRef = &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
			}
			from = append(from, f)
		}
		for range r.IntN(4) {
			var e v1.EnvVar
			if r.IntN(4) > 0 {
				e.ValueFrom = &v1.EnvVarSource{}
				if r.IntN(2) == 0 {
					e.ValueFrom.SecretKeyRef = &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
				}
				if r.IntN(2) == 0 {
					e.ValueFrom.ConfigMapKeyRef = &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
				}
			}
			env = append(env, e)
		}
		return from, env
	}
	some := func() bool { return r.IntN(5) == 0 }
	for i := range 3000 {
		pod := &v1.Pod{}
		for range r.IntN(3) {
			pod.Spec.ImagePullSecrets = append(pod.Spec.ImagePullSecrets, v1.LocalObjectReference{Name: name()})
		}
		for range r.IntN(3) {
			from, env := envs()
			pod.Spec.InitContainers = append(pod.Spec.InitContainers, v1.Container{EnvFrom: from, Env: env})
		}
		for range r.IntN(3) {
			from, env := envs()
			pod.Spec.Containers = append(pod.Spec.Containers, v1.Container{EnvFrom: from, Env: env})
		}
		for range r.IntN(3) {
			from, env := envs()
			pod.Spec.EphemeralContainers = append(pod.Spec.EphemeralContainers,
				v1.EphemeralContainer{EphemeralContainerCommon: v1.EphemeralContainerCommon{EnvFrom: from, Env: env}})
		}
		for range r.IntN(5) {
			var src v1.VolumeSource
			if some() {
				src.AzureFile = &v1.AzureFileVolumeSource{SecretName: name()}
			}
			if some() {
				src.CephFS = &v1.CephFSVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.Cinder = &v1.CinderVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.FlexVolume = &v1.FlexVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.Projected = &v1.ProjectedVolumeSource{}
				for range r.IntN(4) {
					var p v1.VolumeProjection
					if r.IntN(2) == 0 {
						p.Secret = &v1.SecretProjection{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
					}
					if r.IntN(2) == 0 {
						p.ConfigMap = &v1.ConfigMapProjection{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
					}
					src.Projected.Sources = append(src.Projected.Sources, p)
				}
			}
			if some() {
				src.RBD = &v1.RBDVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.Secret = &v1.SecretVolumeSource{SecretName: name()}
			}
			if some() {
				src.ScaleIO = &v1.ScaleIOVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.ISCSI = &v1.ISCSIVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.StorageOS = &v1.StorageOSVolumeSource{SecretRef: lref()}
			}
			if some() {
				src.CSI = &v1.CSIVolumeSource{NodePublishSecretRef: lref()}
			}
			if some() {
				src.ConfigMap = &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: name()}}
			}
			if some() {
				src.CephFS = &v1.CephFSVolumeSource{SecretRef: lref()}
				src.AzureFile = nil
			}
			pod.Spec.Volumes = append(pod.Spec.Volumes, v1.Volume{VolumeSource: src})
		}
		var wantS, wantC []string
		visitPodSecretNames(pod, func(n string) bool { wantS = addName(wantS, n); return true })
		visitPodConfigmapNames(pod, func(n string) bool { wantC = addName(wantC, n); return true })
		gotS, gotC := appendRefNames(nil, nil, pod)
		if !slices.Equal(gotS, wantS) || !slices.Equal(gotC, wantC) {
			t.Fatalf("pod %d: appendRefNames = %q, %q; the visitors give %q, %q", i, gotS, gotC, wantS, wantC)
		}
	}
}

// describe prints pods as namespace/name/uid so that a failure stays readable.
func describe(v any) string {
	id := func(p *v1.Pod) string {
		if p == nil {
			return "<nil>"
		}
		return p.Namespace + "/" + p.Name + "/" + string(p.UID)
	}
	switch x := v.(type) {
	case *v1.Pod:
		return id(x)
	case []*v1.Pod:
		out := make([]string, len(x))
		for i, p := range x {
			out[i] = id(p)
		}
		return fmt.Sprint(out)
	case map[*v1.Pod]*v1.Pod:
		var out []string
		for k, p := range x {
			out = append(out, id(k)+"->"+id(p))
		}
		sort.Strings(out)
		return fmt.Sprint(out)
	case []any:
		out := make([]string, len(x))
		for i, e := range x {
			out[i] = describe(e)
		}
		return fmt.Sprint(out)
	default:
		return fmt.Sprint(v)
	}
}
