package podindex

import (
	"sort"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// visitPodSecretNames calls visitor with every secret name pod references, in the kubelet's order
// (k8s.io/kubernetes/pkg/api/v1/pod.visitPodSecretNames): image pull secrets; then for init, regular and
// ephemeral containers envFrom[].secretRef and env[].valueFrom.secretKeyRef; then volumes (azureFile,
// cephfs, cinder, flexVolume, projected secret sources, rbd, secret, scaleIO, iscsi, storageos, csi
// nodePublishSecretRef). Empty names are skipped; visiting stops when visitor returns false.
// Transitive references (PVC -> PV -> secret) are not visited.
func visitPodSecretNames(pod *v1.Pod, visitor func(name string) bool) bool {
	visit := skipEmptyNames(visitor)
	for _, ref := range pod.Spec.ImagePullSecrets {
		if !visit(ref.Name) {
			return false
		}
	}
	// As the kubelet, a false from the container visit stops the containers but not the volumes.
	visitContainers(&pod.Spec, func(c *v1.Container) bool {
		for _, env := range c.EnvFrom {
			if env.SecretRef != nil && !visit(env.SecretRef.Name) {
				return false
			}
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && !visit(e.ValueFrom.SecretKeyRef.Name) {
				return false
			}
		}
		return true
	})
	for i := range pod.Spec.Volumes {
		src := &pod.Spec.Volumes[i].VolumeSource
		switch {
		case src.AzureFile != nil:
			if len(src.AzureFile.SecretName) > 0 && !visit(src.AzureFile.SecretName) {
				return false
			}
		case src.CephFS != nil:
			if src.CephFS.SecretRef != nil && !visit(src.CephFS.SecretRef.Name) {
				return false
			}
		case src.Cinder != nil:
			if src.Cinder.SecretRef != nil && !visit(src.Cinder.SecretRef.Name) {
				return false
			}
		case src.FlexVolume != nil:
			if src.FlexVolume.SecretRef != nil && !visit(src.FlexVolume.SecretRef.Name) {
				return false
			}
		case src.Projected != nil:
			for j := range src.Projected.Sources {
				if s := src.Projected.Sources[j].Secret; s != nil && !visit(s.Name) {
					return false
				}
			}
		case src.RBD != nil:
			if src.RBD.SecretRef != nil && !visit(src.RBD.SecretRef.Name) {
				return false
			}
		case src.Secret != nil:
			if !visit(src.Secret.SecretName) {
				return false
			}
		case src.ScaleIO != nil:
			if src.ScaleIO.SecretRef != nil && !visit(src.ScaleIO.SecretRef.Name) {
				return false
			}
		case src.ISCSI != nil:
			if src.ISCSI.SecretRef != nil && !visit(src.ISCSI.SecretRef.Name) {
				return false
			}
		case src.StorageOS != nil:
			if src.StorageOS.SecretRef != nil && !visit(src.StorageOS.SecretRef.Name) {
				return false
			}
		case src.CSI != nil:
			if src.CSI.NodePublishSecretRef != nil && !visit(src.CSI.NodePublishSecretRef.Name) {
				return false
			}
		}
	}
	return true
}

// visitPodConfigmapNames calls visitor with every configmap name pod references, in the kubelet's order:
// for init, regular and ephemeral containers envFrom[].configMapRef and env[].valueFrom.configMapKeyRef;
// then volumes (projected configMap sources, configMap). Empty names are skipped.
func visitPodConfigmapNames(pod *v1.Pod, visitor func(name string) bool) bool {
	visit := skipEmptyNames(visitor)
	// As the kubelet, a false from the container visit stops the containers but not the volumes.
	visitContainers(&pod.Spec, func(c *v1.Container) bool {
		for _, env := range c.EnvFrom {
			if env.ConfigMapRef != nil && !visit(env.ConfigMapRef.Name) {
				return false
			}
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil && !visit(e.ValueFrom.ConfigMapKeyRef.Name) {
				return false
			}
		}
		return true
	})
	for i := range pod.Spec.Volumes {
		src := &pod.Spec.Volumes[i].VolumeSource
		switch {
		case src.Projected != nil:
			for j := range src.Projected.Sources {
				if c := src.Projected.Sources[j].ConfigMap; c != nil && !visit(c.Name) {
					return false
				}
			}
		case src.ConfigMap != nil:
			if !visit(src.ConfigMap.Name) {
				return false
			}
		}
	}
	return true
}

func skipEmptyNames(visitor func(string) bool) func(string) bool {
	return func(name string) bool {
		if name == "" {
			return true
		}
		return visitor(name)
	}
}

// visitContainers visits init, regular, then ephemeral containers (an ephemeral container's common part is a
// Container).
func visitContainers(spec *v1.PodSpec, fn func(c *v1.Container) bool) bool {
	for i := range spec.InitContainers {
		if !fn(&spec.InitContainers[i]) {
			return false
		}
	}
	for i := range spec.Containers {
		if !fn(&spec.Containers[i]) {
			return false
		}
	}
	for i := range spec.EphemeralContainers {
		c := v1.Container(spec.EphemeralContainers[i].EphemeralContainerCommon)
		if !fn(&c) {
			return false
		}
	}
	return true
}

// podRefKey is the registration key of a pod, as the kubelet's cacheBasedManager: (namespace, name, uid).
type podRefKey struct {
	namespace, name string
	uid             types.UID
}

// objKey is one referenced object.
type objKey struct {
	kind, namespace, name string
}

// objRef is a referenced object and its count: the number of registrations naming it. Registrations hold
// pointers to their objects, so dropping a reference is a decrement, not a map lookup.
type objRef struct {
	key   objKey
	count int
}

// registration is one registered pod key and the objects its registered version names.
type registration struct {
	key                 podRefKey
	secrets, configMaps []*objRef // de-duplicated, in visit order
	// next is another registered key with the same UID (a pod seen under another name or namespace).
	next *registration
	// inline backs secrets and configMaps when they fit: one allocation per registered pod.
	inline [6]*objRef
	// removed is set when the key is unregistered (a holder of the pointer then looks the key up again).
	removed bool
}

// appendRefNames appends the secret and configmap names pod references to secrets and configMaps,
// de-duplicated, each in the order of visitPodSecretNames and visitPodConfigmapNames. It is the visitors
// without their callbacks, in one pass over the pod: it runs for every applied event.
// TestAppendRefNamesMatchesVisitors keeps it in step with them.
func appendRefNames(secrets, configMaps []string, pod *v1.Pod) ([]string, []string) {
	spec := &pod.Spec
	for i := range spec.ImagePullSecrets {
		secrets = addName(secrets, spec.ImagePullSecrets[i].Name)
	}
	for i := range spec.InitContainers {
		secrets, configMaps = appendEnvNames(secrets, configMaps, spec.InitContainers[i].EnvFrom, spec.InitContainers[i].Env)
	}
	for i := range spec.Containers {
		secrets, configMaps = appendEnvNames(secrets, configMaps, spec.Containers[i].EnvFrom, spec.Containers[i].Env)
	}
	for i := range spec.EphemeralContainers {
		c := &spec.EphemeralContainers[i].EphemeralContainerCommon
		secrets, configMaps = appendEnvNames(secrets, configMaps, c.EnvFrom, c.Env)
	}
	for i := range spec.Volumes {
		src := &spec.Volumes[i].VolumeSource
		// The visitors' switches: the first source set decides, separately for each kind.
		switch {
		case src.AzureFile != nil:
			secrets = addName(secrets, src.AzureFile.SecretName)
		case src.CephFS != nil:
			if src.CephFS.SecretRef != nil {
				secrets = addName(secrets, src.CephFS.SecretRef.Name)
			}
		case src.Cinder != nil:
			if src.Cinder.SecretRef != nil {
				secrets = addName(secrets, src.Cinder.SecretRef.Name)
			}
		case src.FlexVolume != nil:
			if src.FlexVolume.SecretRef != nil {
				secrets = addName(secrets, src.FlexVolume.SecretRef.Name)
			}
		case src.Projected != nil:
			for j := range src.Projected.Sources {
				if s := src.Projected.Sources[j].Secret; s != nil {
					secrets = addName(secrets, s.Name)
				}
			}
		case src.RBD != nil:
			if src.RBD.SecretRef != nil {
				secrets = addName(secrets, src.RBD.SecretRef.Name)
			}
		case src.Secret != nil:
			secrets = addName(secrets, src.Secret.SecretName)
		case src.ScaleIO != nil:
			if src.ScaleIO.SecretRef != nil {
				secrets = addName(secrets, src.ScaleIO.SecretRef.Name)
			}
		case src.ISCSI != nil:
			if src.ISCSI.SecretRef != nil {
				secrets = addName(secrets, src.ISCSI.SecretRef.Name)
			}
		case src.StorageOS != nil:
			if src.StorageOS.SecretRef != nil {
				secrets = addName(secrets, src.StorageOS.SecretRef.Name)
			}
		case src.CSI != nil:
			if src.CSI.NodePublishSecretRef != nil {
				secrets = addName(secrets, src.CSI.NodePublishSecretRef.Name)
			}
		}
		switch {
		case src.Projected != nil:
			for j := range src.Projected.Sources {
				if c := src.Projected.Sources[j].ConfigMap; c != nil {
					configMaps = addName(configMaps, c.Name)
				}
			}
		case src.ConfigMap != nil:
			configMaps = addName(configMaps, src.ConfigMap.Name)
		}
	}
	return secrets, configMaps
}

func appendEnvNames(secrets, configMaps []string, envFrom []v1.EnvFromSource, env []v1.EnvVar) ([]string, []string) {
	for i := range envFrom {
		if r := envFrom[i].SecretRef; r != nil {
			secrets = addName(secrets, r.Name)
		}
		if r := envFrom[i].ConfigMapRef; r != nil {
			configMaps = addName(configMaps, r.Name)
		}
	}
	for i := range env {
		from := env[i].ValueFrom
		if from == nil {
			continue
		}
		if r := from.SecretKeyRef; r != nil {
			secrets = addName(secrets, r.Name)
		}
		if r := from.ConfigMapKeyRef; r != nil {
			configMaps = addName(configMaps, r.Name)
		}
	}
	return secrets, configMaps
}

// addName appends name unless it is empty or already listed.
func addName(list []string, name string) []string {
	if name == "" || contains(list, name) {
		return list
	}
	return append(list, name)
}

// contains is a linear search: a pod names a handful of objects, where a map would cost more.
func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// sameNames reports whether refs name exactly names, in the same order.
func sameNames(refs []*objRef, names []string) bool {
	if len(refs) != len(names) {
		return false
	}
	for i, ref := range refs {
		if ref.key.name != names[i] {
			return false
		}
	}
	return true
}

// Transition is an object whose reference count went 0 -> 1 (Registered) or 1 -> 0.
type Transition struct {
	Kind       string // events.KindSecret or events.KindConfigMap
	Namespace  string
	Name       string
	Registered bool
	Pod        podRefKey
}

// Registry is the reference counting of the kubelet's cache-based secret and configmap managers
// (pkg/kubelet/util/manager.cacheBasedManager with its objectStore), for both kinds at once: registered pods
// keyed by (namespace, name, uid); the first registration of a key adds a reference for every name it
// references; a re-registration adds only names the previous version did not reference and drops only names
// it no longer references; unregistering drops every name of the stored version; an unknown pod is a no-op.
// An object's count is the number of registered pods referencing it. There is no API server here, so the
// TTL object store's fetching and caching have no counterpart: only the references are kept.
//
// Registrations are found by UID first (one string to hash; the few keys sharing a UID are chained), and
// hold pointers to their objects' counts: re-registering a pod that names the same objects (the common
// update) touches no count, and unregistering decrements through the pointers.
//
// Registry is safe for concurrent use.
type Registry struct {
	mu   sync.RWMutex
	pods map[types.UID]*registration
	objs map[objKey]*objRef
	// secretNames and configMapNames are scratch space for the pod being registered (guarded by mu).
	secretNames, configMapNames []string
}

// newRegistry returns an empty registry.
func newRegistry() *Registry {
	return &Registry{pods: make(map[types.UID]*registration), objs: make(map[objKey]*objRef)}
}

// reset empties the registry in place (readers hold the same pointer).
func (r *Registry) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pods = make(map[types.UID]*registration)
	r.objs = make(map[objKey]*objRef)
}

func refKey(pod *v1.Pod) podRefKey {
	return podRefKey{namespace: pod.Namespace, name: pod.Name, uid: pod.UID}
}

// lookup returns the registration of key (nil when not registered).
func (r *Registry) lookup(key podRefKey) *registration {
	for reg := r.pods[key.uid]; reg != nil; reg = reg.next {
		if reg.key == key {
			return reg
		}
	}
	return nil
}

// registerPod registers pod's references and returns the objects whose count went 0 -> 1 or 1 -> 0.
func (r *Registry) registerPod(pod *v1.Pod) []Transition {
	out, _ := r.register(pod, nil)
	return out
}

// register is registerPod given the registration this pod had last time (nil, or one since unregistered or
// of another key: it is looked up). It returns the pod's registration, for the next time.
func (r *Registry) register(pod *v1.Pod, last *registration) ([]Transition, *registration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.secretNames, r.configMapNames = appendRefNames(r.secretNames[:0], r.configMapNames[:0], pod)
	return r.registerLocked(refKey(pod), r.secretNames, r.configMapNames, last)
}

// registerNames is register given appendRefNames of the pod (secrets and configMaps are not kept).
func (r *Registry) registerNames(key podRefKey, secrets, configMaps []string, last *registration) ([]Transition, *registration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.registerLocked(key, secrets, configMaps, last)
}

func (r *Registry) registerLocked(key podRefKey, secrets, configMaps []string, last *registration) ([]Transition, *registration) {
	var out []Transition
	reg := last
	if reg == nil || reg.removed || reg.key != key {
		reg = r.lookup(key)
	}
	if reg == nil {
		reg = &registration{key: key, next: r.pods[key.uid]}
		ns, nc := len(secrets), len(configMaps)
		if ns+nc <= len(reg.inline) {
			reg.secrets, reg.configMaps = reg.inline[:0:ns], reg.inline[ns:ns:ns+nc]
		} else {
			buf := make([]*objRef, ns+nc)
			reg.secrets, reg.configMaps = buf[:0:ns], buf[ns:ns:ns+nc]
		}
		for _, n := range secrets {
			var ref *objRef
			ref, out = r.inc(out, key, events.KindSecret, n)
			reg.secrets = append(reg.secrets, ref)
		}
		for _, n := range configMaps {
			var ref *objRef
			ref, out = r.inc(out, key, events.KindConfigMap, n)
			reg.configMaps = append(reg.configMaps, ref)
		}
		r.pods[key.uid] = reg
		return out, reg
	}
	if sameNames(reg.secrets, secrets) && sameNames(reg.configMaps, configMaps) {
		return nil, reg // nothing added, nothing dropped
	}
	reg.secrets, out = r.diff(out, key, events.KindSecret, reg.secrets, secrets)
	reg.configMaps, out = r.diff(out, key, events.KindConfigMap, reg.configMaps, configMaps)
	return out, reg
}

// unregisterPod drops the references of the registered pod with pod's key; an unknown pod is a no-op.
func (r *Registry) unregisterPod(pod *v1.Pod) []Transition {
	return r.unregisterKey(refKey(pod))
}

func (r *Registry) unregisterKey(key podRefKey) []Transition {
	r.mu.Lock()
	defer r.mu.Unlock()
	var prev *registration
	reg := r.pods[key.uid]
	for reg != nil && reg.key != key {
		prev, reg = reg, reg.next
	}
	if reg == nil {
		return nil
	}
	switch {
	case prev != nil:
		prev.next = reg.next
	case reg.next != nil:
		r.pods[key.uid] = reg.next
	default:
		delete(r.pods, key.uid)
	}
	reg.removed, reg.next = true, nil
	var out []Transition
	for _, ref := range reg.secrets {
		out = r.dec(out, key, ref)
	}
	for _, ref := range reg.configMaps {
		out = r.dec(out, key, ref)
	}
	return out
}

// diff re-registers one kind: names not in prev are added (in next's order), then objects not in next are
// dropped (in prev's order). It returns the objects of next.
func (r *Registry) diff(out []Transition, key podRefKey, kind string, prev []*objRef, next []string) ([]*objRef, []Transition) {
	refs := make([]*objRef, 0, len(next))
	for _, n := range next {
		var ref *objRef
		for _, p := range prev {
			if p.key.name == n {
				ref = p
				break
			}
		}
		if ref == nil {
			ref, out = r.inc(out, key, kind, n)
		}
		refs = append(refs, ref)
	}
	for _, p := range prev {
		if !contains(next, p.key.name) {
			out = r.dec(out, key, p)
		}
	}
	return refs, out
}

func (r *Registry) inc(out []Transition, key podRefKey, kind, name string) (*objRef, []Transition) {
	k := objKey{kind: kind, namespace: key.namespace, name: name}
	ref := r.objs[k]
	if ref == nil {
		ref = &objRef{key: k}
		r.objs[k] = ref
	}
	ref.count++
	if ref.count == 1 {
		out = append(out, Transition{Kind: kind, Namespace: key.namespace, Name: name, Registered: true, Pod: key})
	}
	return ref, out
}

// dec drops one reference to ref; the last one removes the object.
func (r *Registry) dec(out []Transition, key podRefKey, ref *objRef) []Transition {
	ref.count--
	if ref.count > 0 {
		return out
	}
	delete(r.objs, ref.key)
	return append(out, Transition{Kind: ref.key.kind, Namespace: ref.key.namespace, Name: ref.key.name, Pod: key})
}

// Count is the reference count of a secret or configmap (0 when not registered).
func (r *Registry) Count(kind, namespace, name string) int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if ref := r.objs[objKey{kind: kind, namespace: namespace, name: name}]; ref != nil {
		return ref.count
	}
	return 0
}

// Registered reports whether the object is registered (the kubelet's GetObject would not answer
// "object ... not registered").
func (r *Registry) isRegistered(kind, namespace, name string) bool {
	return r.Count(kind, namespace, name) > 0
}

// isPodRegistered reports whether pod's key is registered.
func (r *Registry) isPodRegistered(pod *v1.Pod) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.lookup(refKey(pod)) != nil
}

// Refs lists every registered object with its count, sorted by kind, namespace and name.
func (r *Registry) Refs() []events.Ref {
	r.mu.RLock()
	out := make([]events.Ref, 0, len(r.objs))
	for k, ref := range r.objs {
		out = append(out, events.Ref{Kind: k.kind, Namespace: k.namespace, Name: k.name, Count: ref.count})
	}
	r.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Kind != b.Kind {
			return a.Kind < b.Kind
		}
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		return a.Name < b.Name
	})
	return out
}
