package podindex

import (
	"sort"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// VisitPodSecretNames calls visitor with every secret name pod references, in the kubelet's order
// (k8s.io/kubernetes/pkg/api/v1/pod.VisitPodSecretNames): image pull secrets; then for init, regular and
// ephemeral containers envFrom[].secretRef and env[].valueFrom.secretKeyRef; then volumes (azureFile,
// cephfs, cinder, flexVolume, projected secret sources, rbd, secret, scaleIO, iscsi, storageos, csi
// nodePublishSecretRef). Empty names are skipped; visiting stops when visitor returns false.
// Transitive references (PVC -> PV -> secret) are not visited.
func VisitPodSecretNames(pod *v1.Pod, visitor func(name string) bool) bool {
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

// VisitPodConfigmapNames calls visitor with every configmap name pod references, in the kubelet's order:
// for init, regular and ephemeral containers envFrom[].configMapRef and env[].valueFrom.configMapKeyRef;
// then volumes (projected configMap sources, configMap). Empty names are skipped.
func VisitPodConfigmapNames(pod *v1.Pod, visitor func(name string) bool) bool {
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

// podNames is what a registered pod references.
type podNames struct {
	secrets, configMaps []string // de-duplicated, in visit order
}

func referencedNames(pod *v1.Pod) podNames {
	n := podNames{secrets: make([]string, 0, 4), configMaps: make([]string, 0, 4)}
	VisitPodSecretNames(pod, func(name string) bool {
		if !contains(n.secrets, name) {
			n.secrets = append(n.secrets, name)
		}
		return true
	})
	VisitPodConfigmapNames(pod, func(name string) bool {
		if !contains(n.configMaps, name) {
			n.configMaps = append(n.configMaps, name)
		}
		return true
	})
	return n
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
// Registry is safe for concurrent use.
type Registry struct {
	mu     sync.RWMutex
	pods   map[podRefKey]podNames
	counts map[objKey]int
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{pods: make(map[podRefKey]podNames), counts: make(map[objKey]int)}
}

func refKey(pod *v1.Pod) podRefKey {
	return podRefKey{namespace: pod.Namespace, name: pod.Name, uid: pod.UID}
}

// RegisterPod registers pod's references and returns the objects whose count went 0 -> 1 or 1 -> 0.
func (r *Registry) RegisterPod(pod *v1.Pod) []Transition {
	names := referencedNames(pod)
	key := refKey(pod)
	r.mu.Lock()
	defer r.mu.Unlock()
	prev, had := r.pods[key]
	r.pods[key] = names
	var out []Transition
	if !had {
		out = r.addAll(out, key, events.KindSecret, names.secrets)
		return r.addAll(out, key, events.KindConfigMap, names.configMaps)
	}
	out = r.diff(out, key, events.KindSecret, prev.secrets, names.secrets)
	return r.diff(out, key, events.KindConfigMap, prev.configMaps, names.configMaps)
}

// UnregisterPod drops the references of the registered pod with pod's key; an unknown pod is a no-op.
func (r *Registry) UnregisterPod(pod *v1.Pod) []Transition {
	return r.unregisterKey(refKey(pod))
}

func (r *Registry) unregisterKey(key podRefKey) []Transition {
	r.mu.Lock()
	defer r.mu.Unlock()
	prev, had := r.pods[key]
	if !had {
		return nil
	}
	delete(r.pods, key)
	var out []Transition
	for _, n := range prev.secrets {
		out = r.dec(out, key, events.KindSecret, n)
	}
	for _, n := range prev.configMaps {
		out = r.dec(out, key, events.KindConfigMap, n)
	}
	return out
}

func (r *Registry) addAll(out []Transition, key podRefKey, kind string, names []string) []Transition {
	for _, n := range names {
		out = r.inc(out, key, kind, n)
	}
	return out
}

func (r *Registry) diff(out []Transition, key podRefKey, kind string, prev, next []string) []Transition {
	for _, n := range next {
		if !contains(prev, n) {
			out = r.inc(out, key, kind, n)
		}
	}
	for _, n := range prev {
		if !contains(next, n) {
			out = r.dec(out, key, kind, n)
		}
	}
	return out
}

func (r *Registry) inc(out []Transition, key podRefKey, kind, name string) []Transition {
	k := objKey{kind: kind, namespace: key.namespace, name: name}
	r.counts[k]++
	if r.counts[k] == 1 {
		out = append(out, Transition{Kind: kind, Namespace: key.namespace, Name: name, Registered: true, Pod: key})
	}
	return out
}

func (r *Registry) dec(out []Transition, key podRefKey, kind, name string) []Transition {
	k := objKey{kind: kind, namespace: key.namespace, name: name}
	c, ok := r.counts[k]
	if !ok {
		return out // never goes negative
	}
	if c <= 1 {
		delete(r.counts, k)
		return append(out, Transition{Kind: kind, Namespace: key.namespace, Name: name, Pod: key})
	}
	r.counts[k] = c - 1
	return out
}

// Count is the reference count of a secret or configmap (0 when not registered).
func (r *Registry) Count(kind, namespace, name string) int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.counts[objKey{kind: kind, namespace: namespace, name: name}]
}

// Registered reports whether the object is registered (the kubelet's GetObject would not answer
// "object ... not registered").
func (r *Registry) Registered(kind, namespace, name string) bool { return r.Count(kind, namespace, name) > 0 }

// IsPodRegistered reports whether pod's key is registered.
func (r *Registry) IsPodRegistered(pod *v1.Pod) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	_, ok := r.pods[refKey(pod)]
	return ok
}

// Refs lists every registered object with its count, sorted by kind, namespace and name.
func (r *Registry) Refs() []events.Ref {
	r.mu.RLock()
	out := make([]events.Ref, 0, len(r.counts))
	for k, c := range r.counts {
		out = append(out, events.Ref{Kind: k.kind, Namespace: k.namespace, Name: k.name, Count: c})
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
