package podindex

import (
	"fmt"
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// The helpers of pkg/kubelet/util/manager/cache_based_manager_test.go.
type envSecrets struct {
	envVarNames  []string
	envFromNames []string
}

type secretsToAttach struct {
	imagePullSecretNames []string
	containerEnvSecrets  []envSecrets
}

func podWithSecrets(ns, podName string, toAttach secretsToAttach) *v1.Pod {
	return podWithSecretsAndUID(ns, podName, fmt.Sprintf("%s/%s", ns, podName), toAttach)
}

func podWithSecretsAndUID(ns, podName, podUID string, toAttach secretsToAttach) *v1.Pod {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: podName, UID: types.UID(podUID)}}
	for _, name := range toAttach.imagePullSecretNames {
		pod.Spec.ImagePullSecrets = append(pod.Spec.ImagePullSecrets, v1.LocalObjectReference{Name: name})
	}
	for i, secrets := range toAttach.containerEnvSecrets {
		c := v1.Container{Name: fmt.Sprintf("container-%d", i)}
		for _, name := range secrets.envFromNames {
			c.EnvFrom = append(c.EnvFrom, v1.EnvFromSource{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: name}}})
		}
		for _, name := range secrets.envVarNames {
			c.Env = append(c.Env, v1.EnvVar{ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: name}}}})
		}
		pod.Spec.Containers = append(pod.Spec.Containers, c)
	}
	return pod
}

// manager is what the kubelet's tests drive: registerPod and unregisterPod, and a secret's reference count.
// Two implementations run every test: the Registry itself, and a State fed pod events (registerPod is a
// pod.updated event, unregisterPod a pod.deleted event).
type manager interface {
	registerPod(pod *v1.Pod)
	unregisterPod(pod *v1.Pod)
	refs(ns, name string) int
}

type registryManager struct{ r *Registry }

func (m registryManager) registerPod(pod *v1.Pod)   { m.r.registerPod(pod) }
func (m registryManager) unregisterPod(pod *v1.Pod) { m.r.unregisterPod(pod) }
func (m registryManager) refs(ns, name string) int  { return m.r.Count(events.KindSecret, ns, name) }

type stateManager struct {
	s   *State
	seq *uint64
}

func (m stateManager) apply(action string, pod *v1.Pod) {
	*m.seq++
	m.s.Apply(*m.seq, PodEvent{Action: action, Pod: pod.DeepCopy()})
}
func (m stateManager) registerPod(pod *v1.Pod)   { m.apply(events.ActionUpdated, pod) }
func (m stateManager) unregisterPod(pod *v1.Pod) { m.apply(events.ActionDeleted, pod) }
func (m stateManager) refs(ns, name string) int  { return m.s.Refs.Count(events.KindSecret, ns, name) }

func managers() map[string]func() manager {
	return map[string]func() manager{
		"registry":   func() manager { return registryManager{newRegistry()} },
		"pod events": func() manager { var seq uint64; return stateManager{s: NewState(), seq: &seq} },
	}
}

func TestRegisterIdempotence(t *testing.T) {
	for mname, newManager := range managers() {
		t.Run(mname, func(t *testing.T) {
			m := newManager()
			s1 := secretsToAttach{imagePullSecretNames: []string{"s1"}}
			steps := []struct {
				name     string
				register bool
				pod      string
				want     int
			}{
				{"register name1", true, "name1", 1},
				{"register name1 again", true, "name1", 1},
				{"register name2", true, "name2", 2},
				{"unregister name1", false, "name1", 1},
				{"unregister name1 again", false, "name1", 1},
				{"unregister name2", false, "name2", 0},
			}
			for _, st := range steps {
				pod := podWithSecrets("ns1", st.pod, s1)
				if st.register {
					m.registerPod(pod)
				} else {
					m.unregisterPod(pod)
				}
				if got := m.refs("ns1", "s1"); got != st.want {
					t.Fatalf("%s: refs(s1) = %d, want %d", st.name, got, st.want)
				}
			}
		})
	}
}

func TestCacheRefcounts(t *testing.T) {
	for mname, newManager := range managers() {
		t.Run(mname, func(t *testing.T) {
			m := newManager()
			s1 := secretsToAttach{
				imagePullSecretNames: []string{"s1"},
				containerEnvSecrets: []envSecrets{
					{envVarNames: []string{"s1"}, envFromNames: []string{"s10"}},
					{envVarNames: []string{"s2"}},
					{envVarNames: []string{"s3"}},
				},
			}
			m.registerPod(podWithSecrets("ns1", "name1", s1))
			m.registerPod(podWithSecrets("ns1", "name2", s1))
			s2 := secretsToAttach{
				imagePullSecretNames: []string{"s2"},
				containerEnvSecrets: []envSecrets{
					{envVarNames: []string{"s4"}},
					{envVarNames: []string{"s5"}, envFromNames: []string{"s50"}},
				},
			}
			m.registerPod(podWithSecrets("ns1", "name2", s2))
			m.registerPod(podWithSecrets("ns1", "name3", s2))
			m.registerPod(podWithSecrets("ns1", "name4", s2))
			m.unregisterPod(podWithSecrets("ns1", "name3", s2))
			s3 := secretsToAttach{
				imagePullSecretNames: []string{"s1"},
				containerEnvSecrets: []envSecrets{
					{envVarNames: []string{"s3"}, envFromNames: []string{"s30"}},
					{envVarNames: []string{"s5"}},
				},
			}
			m.registerPod(podWithSecrets("ns1", "name5", s3))
			m.registerPod(podWithSecrets("ns1", "name6", s3))
			s4 := secretsToAttach{
				imagePullSecretNames: []string{"s3"},
				containerEnvSecrets:  []envSecrets{{envVarNames: []string{"s6"}}, {envFromNames: []string{"s60"}}},
			}
			m.registerPod(podWithSecrets("ns1", "name7", s4))
			m.unregisterPod(podWithSecrets("ns1", "name7", s4))
			// Add + Update + Remove.
			m.registerPod(podWithSecrets("ns1", "other-name", s1))
			m.registerPod(podWithSecrets("ns1", "other-name", s2))
			m.unregisterPod(podWithSecrets("ns1", "other-name", s2))
			// No-op update.
			s5 := secretsToAttach{containerEnvSecrets: []envSecrets{{envVarNames: []string{"s7"}}, {envFromNames: []string{"s70"}}}}
			m.registerPod(podWithSecrets("ns1", "noop-pod", s5))
			m.registerPod(podWithSecrets("ns1", "noop-pod", s5))

			want := []struct {
				name string
				refs int
			}{
				{"s1", 3}, {"s10", 1}, {"s2", 3}, {"s3", 3}, {"s30", 2}, {"s4", 2},
				{"s5", 4}, {"s50", 2}, {"s6", 0}, {"s60", 0}, {"s7", 1}, {"s70", 1},
			}
			for _, w := range want {
				if got := m.refs("ns1", w.name); got != w.refs {
					t.Errorf("refs(%s) = %d, want %d", w.name, got, w.refs)
				}
			}

			// Interleaved register/unregister with identical names and different UIDs.
			secret1 := secretsToAttach{containerEnvSecrets: []envSecrets{{envVarNames: []string{"secret1"}}}}
			secret2 := secretsToAttach{containerEnvSecrets: []envSecrets{{envVarNames: []string{"secret2"}}}}
			check := func(step string, want1, want2 int) {
				t.Helper()
				if g1, g2 := m.refs("nsinterleaved", "secret1"), m.refs("nsinterleaved", "secret2"); g1 != want1 || g2 != want2 {
					t.Fatalf("%s: refs = %d, %d; want %d, %d", step, g1, g2, want1, want2)
				}
			}
			check("precondition", 0, 0)
			m.registerPod(podWithSecretsAndUID("nsinterleaved", "pod", "poduid1", secret1))
			check("register poduid1", 1, 0)
			m.registerPod(podWithSecretsAndUID("nsinterleaved", "pod", "poduid2", secret2))
			check("register poduid2", 1, 1)
			m.unregisterPod(podWithSecretsAndUID("nsinterleaved", "pod", "poduid1", secretsToAttach{}))
			check("unregister poduid1", 0, 1)
			m.unregisterPod(podWithSecretsAndUID("nsinterleaved", "pod", "poduid2", secretsToAttach{}))
			check("unregister poduid2", 0, 0)
		})
	}
}

// TestCacheInvalidation follows the kubelet's test as reference changes: its API fetches happen exactly for
// the names a registration adds (AddReference invalidates them), which here are the added references, and a
// count going 0 -> 1 is a registered transition.
func TestCacheInvalidation(t *testing.T) {
	r := newRegistry()
	first := secretsToAttach{
		imagePullSecretNames: []string{"s1"},
		containerEnvSecrets:  []envSecrets{{envVarNames: []string{"s1"}, envFromNames: []string{"s10"}}, {envVarNames: []string{"s2"}}},
	}
	second := secretsToAttach{
		imagePullSecretNames: []string{"s1"},
		containerEnvSecrets: []envSecrets{
			{envVarNames: []string{"s1"}}, {envVarNames: []string{"s2"}, envFromNames: []string{"s20"}}, {envVarNames: []string{"s3"}},
		},
	}
	type tr struct {
		name       string
		registered bool
	}
	got := func(ts []Transition) []tr {
		out := []tr{}
		for _, x := range ts {
			out = append(out, tr{x.Name, x.Registered})
		}
		return out
	}
	counts := func() map[string]int {
		out := map[string]int{}
		for _, ref := range r.Refs() {
			out[ref.Name] = ref.Count
		}
		return out
	}
	steps := []struct {
		name       string
		pod        *v1.Pod
		wantTrans  []tr
		wantCounts map[string]int
	}{
		{"register name1: s1, s10, s2 referenced (3 fetches)", podWithSecrets("ns1", "name1", first),
			[]tr{{"s1", true}, {"s10", true}, {"s2", true}}, map[string]int{"s1": 1, "s10": 1, "s2": 1}},
		{"re-register name1: only s20 and s3 are new (2 fetches), s10 dropped", podWithSecrets("ns1", "name1", second),
			[]tr{{"s20", true}, {"s3", true}, {"s10", false}}, map[string]int{"s1": 1, "s2": 1, "s20": 1, "s3": 1}},
		{"register name2 with the first set: s1, s10, s2 referenced again (3 fetches)", podWithSecrets("ns1", "name2", first),
			[]tr{{"s10", true}}, map[string]int{"s1": 2, "s10": 1, "s2": 2, "s20": 1, "s3": 1}},
	}
	for _, st := range steps {
		ts := r.registerPod(st.pod)
		if !reflect.DeepEqual(got(ts), st.wantTrans) {
			t.Errorf("%s: transitions %v, want %v", st.name, got(ts), st.wantTrans)
		}
		if c := counts(); !reflect.DeepEqual(c, st.wantCounts) {
			t.Errorf("%s: counts %v, want %v", st.name, c, st.wantCounts)
		}
	}
}

func TestCacheBasedSecretManager(t *testing.T) {
	for mname, newManager := range managers() {
		t.Run(mname, func(t *testing.T) {
			m := newManager()
			s1 := secretsToAttach{
				imagePullSecretNames: []string{"s1"},
				containerEnvSecrets:  []envSecrets{{envVarNames: []string{"s1"}}, {envVarNames: []string{"s2"}}, {envFromNames: []string{"s20"}}},
			}
			m.registerPod(podWithSecrets("ns1", "name1", s1))
			s2 := secretsToAttach{
				imagePullSecretNames: []string{"s1"},
				containerEnvSecrets:  []envSecrets{{envVarNames: []string{"s3"}}, {envVarNames: []string{"s4"}}, {envFromNames: []string{"s40"}}},
			}
			m.registerPod(podWithSecrets("ns1", "name1", s2))
			m.registerPod(podWithSecrets("ns2", "name2", s2))
			s3 := secretsToAttach{
				imagePullSecretNames: []string{"s5"},
				containerEnvSecrets:  []envSecrets{{envVarNames: []string{"s6"}}, {envFromNames: []string{"s60"}}},
			}
			m.registerPod(podWithSecrets("ns3", "name", s3))
			m.unregisterPod(podWithSecrets("ns3", "name", s3))

			existing := map[string]bool{"s1": true, "s3": true, "s4": true, "s40": true}
			for _, ns := range []string{"ns1", "ns2", "ns3"} {
				for _, secret := range []string{"s1", "s2", "s3", "s4", "s5", "s6", "s20", "s40", "s50"} {
					want := existing[secret] && (ns == "ns1" || ns == "ns2")
					if got := m.refs(ns, secret) > 0; got != want {
						t.Errorf("%s/%s registered = %v, want %v", ns, secret, got, want)
					}
				}
			}
		})
	}
}

// TestReferenceSites checks every place in a pod spec that names a secret or a configmap, for init, regular
// and ephemeral containers, and the kubelet's visit order.
func TestReferenceSites(t *testing.T) {
	envs := func(p string) ([]v1.EnvFromSource, []v1.EnvVar) {
		return []v1.EnvFromSource{
				{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: p + "-envfrom-secret"}}},
				{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: p + "-envfrom-cm"}}},
			}, []v1.EnvVar{
				{Name: "a", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: p + "-env-secret"}}}},
				{Name: "b", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: p + "-env-cm"}}}},
				{Name: "c", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
			}
	}
	ref := func(n string) *v1.LocalObjectReference { return &v1.LocalObjectReference{Name: n} }
	ief, ie := envs("init")
	cef, ce := envs("main")
	eef, ee := envs("eph")
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u"}, Spec: v1.PodSpec{
		ImagePullSecrets: []v1.LocalObjectReference{{Name: "pull"}, {Name: ""}},
		InitContainers:   []v1.Container{{Name: "i", EnvFrom: ief, Env: ie}},
		Containers:       []v1.Container{{Name: "c", EnvFrom: cef, Env: ce}},
		EphemeralContainers: []v1.EphemeralContainer{{EphemeralContainerCommon: v1.EphemeralContainerCommon{
			Name: "e", EnvFrom: eef, Env: ee}}},
		Volumes: []v1.Volume{
			{Name: "1", VolumeSource: v1.VolumeSource{AzureFile: &v1.AzureFileVolumeSource{SecretName: "azure"}}},
			{Name: "2", VolumeSource: v1.VolumeSource{CephFS: &v1.CephFSVolumeSource{SecretRef: ref("cephfs")}}},
			{Name: "3", VolumeSource: v1.VolumeSource{Cinder: &v1.CinderVolumeSource{SecretRef: ref("cinder")}}},
			{Name: "4", VolumeSource: v1.VolumeSource{FlexVolume: &v1.FlexVolumeSource{SecretRef: ref("flex")}}},
			{Name: "5", VolumeSource: v1.VolumeSource{Projected: &v1.ProjectedVolumeSource{Sources: []v1.VolumeProjection{
				{Secret: &v1.SecretProjection{LocalObjectReference: v1.LocalObjectReference{Name: "projected-secret"}}},
				{ConfigMap: &v1.ConfigMapProjection{LocalObjectReference: v1.LocalObjectReference{Name: "projected-cm"}}},
			}}}},
			{Name: "6", VolumeSource: v1.VolumeSource{RBD: &v1.RBDVolumeSource{SecretRef: ref("rbd")}}},
			{Name: "7", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "secret-vol"}}},
			{Name: "8", VolumeSource: v1.VolumeSource{ScaleIO: &v1.ScaleIOVolumeSource{SecretRef: ref("scaleio")}}},
			{Name: "9", VolumeSource: v1.VolumeSource{ISCSI: &v1.ISCSIVolumeSource{SecretRef: ref("iscsi")}}},
			{Name: "10", VolumeSource: v1.VolumeSource{StorageOS: &v1.StorageOSVolumeSource{SecretRef: ref("storageos")}}},
			{Name: "11", VolumeSource: v1.VolumeSource{CSI: &v1.CSIVolumeSource{Driver: "d", NodePublishSecretRef: ref("csi")}}},
			{Name: "12", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "cm-vol"}}}},
			{Name: "13", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc"}}},
		},
	}}
	var secrets, cms []string
	visitPodSecretNames(pod, func(n string) bool { secrets = append(secrets, n); return true })
	visitPodConfigmapNames(pod, func(n string) bool { cms = append(cms, n); return true })
	wantSecrets := []string{"pull", "init-envfrom-secret", "init-env-secret", "main-envfrom-secret", "main-env-secret",
		"eph-envfrom-secret", "eph-env-secret", "azure", "cephfs", "cinder", "flex", "projected-secret", "rbd",
		"secret-vol", "scaleio", "iscsi", "storageos", "csi"}
	wantCMs := []string{"init-envfrom-cm", "init-env-cm", "main-envfrom-cm", "main-env-cm", "eph-envfrom-cm", "eph-env-cm",
		"projected-cm", "cm-vol"}
	if !reflect.DeepEqual(secrets, wantSecrets) {
		t.Errorf("secrets %v\nwant    %v", secrets, wantSecrets)
	}
	if !reflect.DeepEqual(cms, wantCMs) {
		t.Errorf("configmaps %v\nwant       %v", cms, wantCMs)
	}
	r := newRegistry()
	ts := r.registerPod(pod)
	if len(ts) != len(wantSecrets)+len(wantCMs) {
		t.Errorf("registering gave %d transitions, want %d", len(ts), len(wantSecrets)+len(wantCMs))
	}
	if r.Count(events.KindConfigMap, "ns", "cm-vol") != 1 || r.Count(events.KindSecret, "ns", "cm-vol") != 0 {
		t.Error("a configmap is counted as a secret or not at all")
	}
}

// TestTerminalAndDeletedPodsUnregister: a terminal phase and a delete unregister; a terminal pod stays indexed.
func TestTerminalAndDeletedPodsUnregister(t *testing.T) {
	s := NewState()
	pod := podWithSecrets("ns", "job", secretsToAttach{imagePullSecretNames: []string{"pull"}})
	pod.Spec.Containers = []v1.Container{{Name: "c", Image: "busybox:1"}}
	steps := []struct {
		name      string
		action    string
		phase     v1.PodPhase
		wantRefs  int
		wantInUse []string
		wantPod   bool
	}{
		{"added pending", events.ActionAdded, v1.PodPending, 1, []string{"busybox:1"}, true},
		{"running", events.ActionUpdated, v1.PodRunning, 1, []string{"busybox:1"}, true},
		{"succeeded", events.ActionUpdated, v1.PodSucceeded, 0, []string{}, true},
		{"deleted", events.ActionDeleted, v1.PodSucceeded, 0, []string{}, false},
		{"deleted again is a no-op", events.ActionDeleted, v1.PodSucceeded, 0, []string{}, false},
		{"re-added failed", events.ActionAdded, v1.PodFailed, 0, []string{}, true},
	}
	for i, st := range steps {
		p := pod.DeepCopy()
		p.Status.Phase = st.phase
		s.Apply(uint64(i+1), PodEvent{Action: st.action, Pod: p})
		if got := s.Refs.Count(events.KindSecret, "ns", "pull"); got != st.wantRefs {
			t.Errorf("%s: refs = %d, want %d", st.name, got, st.wantRefs)
		}
		if got := s.InUseImages(); !reflect.DeepEqual(got, st.wantInUse) {
			t.Errorf("%s: in use = %v, want %v", st.name, got, st.wantInUse)
		}
		if _, ok := s.Index.getPodByUID(p.UID); ok != st.wantPod {
			t.Errorf("%s: indexed = %v, want %v", st.name, ok, st.wantPod)
		}
	}
}
