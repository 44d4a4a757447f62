package podindex

// This file keeps the index, registry and state as they were before they were optimised (commit 922ad8f), as
// a reference model: TestModelEquivalence applies random event sequences to both and compares every answer.

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// mEntry is one indexed pod and the order of its last upsert (the stream sequence of the event that stored
// it, so the order survives a restart).
type mEntry struct {
	pod   *v1.Pod
	order uint64
	raw   []byte // the pod's JSON as received (what the snapshot stores), nil when added in process
}

// mIndex is the kubelet's pod manager (pkg/kubelet/pod.basicManager): non-mirror pods by UID and by full name,
// mirror pods by UID and by full name, and the mirror-to-static UID translation.
//
// Unlike the kubelet, the full-name maps and the translation are derived from the set of live pods and the
// order of their upserts, not kept as maps that each call patches. Every kubelet answer is the same in the
// kubelet's own test cases and whenever at most one pod and one mirror pod share a full name; the derived
// form fixes the quirks the patched maps have, and makes the index a function of its pods, so a snapshot
// plus a replay of the events after it gives back exactly the same index:
//   - removing a static pod drops its translation (the kubelet keeps a stale mirror -> static mEntry: W-F);
//   - removing a pod that shares its full name with a newer pod leaves the newer one findable by full name
//     (the kubelet deletes the full-name mEntry whoever it points to);
//   - a pod upserted again under another name or namespace leaves its old full name (the kubelet keeps the
//     old full-name mEntry pointing at it).
//
// Two pods (or two mirror pods) with one full name both stay indexed by UID until each is deleted, and the
// full name resolves to the one upserted last, as in the kubelet.
//
// mIndex is safe for concurrent use.
type mIndex struct {
	mu sync.RWMutex
	// next orders upserts made in process (AddPod without a stream sequence).
	next             uint64
	pods             map[types.UID]*mEntry
	mirrors          map[types.UID]*mEntry
	podsByFullName   map[string][]*mEntry
	mirrorByFullName map[string][]*mEntry
}

// newMIndex returns an empty index.
func newMIndex() *mIndex {
	ix := &mIndex{}
	ix.reset()
	return ix
}

func (ix *mIndex) reset() {
	ix.pods = make(map[types.UID]*mEntry)
	ix.mirrors = make(map[types.UID]*mEntry)
	ix.podsByFullName = make(map[string][]*mEntry)
	ix.mirrorByFullName = make(map[string][]*mEntry)
}

// SetPods replaces every pod with pods, as if each were added in order.
func (ix *mIndex) SetPods(pods []*v1.Pod) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.reset()
	for _, p := range pods {
		ix.next++
		ix.upsertLocked(p, nil, ix.next)
	}
}

// AddPod adds or updates pod (AddPod and UpdatePod are the same upsert, as in the kubelet).
func (ix *mIndex) AddPod(pod *v1.Pod) { ix.UpdatePod(pod) }

// UpdatePod adds or updates pod.
func (ix *mIndex) UpdatePod(pod *v1.Pod) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.next++
	ix.upsertLocked(pod, nil, ix.next)
}

// upsert stores pod with the order of its event; it returns the pod it replaced (same UID), if any.
func (ix *mIndex) upsert(pod *v1.Pod, raw []byte, order uint64) *v1.Pod {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.next = max(ix.next, order)
	return ix.upsertLocked(pod, raw, order)
}

func (ix *mIndex) upsertLocked(pod *v1.Pod, raw []byte, order uint64) *v1.Pod {
	mirror := IsMirrorPod(pod)
	// The common update: same UID, same kind, same full name: replace in place.
	m := ix.pods
	if mirror {
		m = ix.mirrors
	}
	if e, ok := m[pod.UID]; ok && e.pod.Name == pod.Name && e.pod.Namespace == pod.Namespace {
		prev := e.pod
		e.pod, e.order, e.raw = pod, order, raw
		return prev
	}
	prev := ix.removeLocked(pod.UID)
	e := &mEntry{pod: pod, order: order, raw: raw}
	fn := PodFullName(pod)
	if mirror {
		ix.mirrors[pod.UID] = e
		ix.mirrorByFullName[fn] = append(ix.mirrorByFullName[fn], e)
	} else {
		ix.pods[pod.UID] = e
		ix.podsByFullName[fn] = append(ix.podsByFullName[fn], e)
	}
	return prev
}

// RemovePod removes the pod with pod's UID (mirror or not); an unknown pod is a no-op.
func (ix *mIndex) RemovePod(pod *v1.Pod) { ix.remove(pod.UID) }

func (ix *mIndex) remove(uid types.UID) *v1.Pod {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.removeLocked(uid)
}

func (ix *mIndex) removeLocked(uid types.UID) *v1.Pod {
	if e, ok := ix.pods[uid]; ok {
		delete(ix.pods, uid)
		mDropEntry(ix.podsByFullName, PodFullName(e.pod), e)
		return e.pod
	}
	if e, ok := ix.mirrors[uid]; ok {
		delete(ix.mirrors, uid)
		mDropEntry(ix.mirrorByFullName, PodFullName(e.pod), e)
		return e.pod
	}
	return nil
}

func mDropEntry(m map[string][]*mEntry, fn string, e *mEntry) {
	list := m[fn]
	i := slices.Index(list, e)
	if i < 0 {
		return
	}
	list = slices.Delete(list, i, i+1)
	if len(list) == 0 {
		delete(m, fn)
		return
	}
	m[fn] = list
}

// mNewest is the most recently upserted mEntry of list.
func mNewest(list []*mEntry) *mEntry {
	var best *mEntry
	for _, e := range list {
		if best == nil || e.order > best.order {
			best = e
		}
	}
	return best
}

func (ix *mIndex) podByFullNameLocked(fn string) (*v1.Pod, bool) {
	if e := mNewest(ix.podsByFullName[fn]); e != nil {
		return e.pod, true
	}
	return nil, false
}

func (ix *mIndex) mirrorByFullNameLocked(fn string) (*v1.Pod, bool) {
	if e := mNewest(ix.mirrorByFullName[fn]); e != nil {
		return e.pod, true
	}
	return nil, false
}

// GetPods returns the non-mirror pods.
func (ix *mIndex) GetPods() []*v1.Pod {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return mEntriesToPods(ix.pods)
}

func mEntriesToPods(m map[types.UID]*mEntry) []*v1.Pod {
	out := make([]*v1.Pod, 0, len(m))
	for _, e := range m {
		out = append(out, e.pod)
	}
	return out
}

// Len is the number of non-mirror and mirror pods.
func (ix *mIndex) Len() (pods, mirrors int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.pods), len(ix.mirrors)
}

// GetPodsAndMirrorPods returns the pods, the mirror pods, and the full names of the orphaned mirror pods
// (mirror full names with no non-mirror pod of that full name; nil when there are none).
func (ix *mIndex) GetPodsAndMirrorPods() (pods, mirrorPods []*v1.Pod, orphanedMirrorPodFullNames []string) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	pods = mEntriesToPods(ix.pods)
	mirrorPods = mEntriesToPods(ix.mirrors)
	for fn := range ix.mirrorByFullName {
		if _, ok := ix.podsByFullName[fn]; !ok {
			orphanedMirrorPodFullNames = append(orphanedMirrorPodFullNames, fn)
		}
	}
	sort.Strings(orphanedMirrorPodFullNames)
	return pods, mirrorPods, orphanedMirrorPodFullNames
}

// GetStaticPodToMirrorPodMap maps every static pod to its mirror pod (nil when it has none).
func (ix *mIndex) GetStaticPodToMirrorPodMap() map[*v1.Pod]*v1.Pod {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make(map[*v1.Pod]*v1.Pod)
	for _, e := range ix.pods {
		if IsStaticPod(e.pod) {
			m, _ := ix.mirrorByFullNameLocked(PodFullName(e.pod))
			out[e.pod] = m
		}
	}
	return out
}

// GetPodByUID returns the non-mirror pod with uid.
func (ix *mIndex) GetPodByUID(uid types.UID) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.pods[uid]; ok {
		return e.pod, true
	}
	return nil, false
}

// GetMirrorPodByUID returns the mirror pod with uid.
func (ix *mIndex) GetMirrorPodByUID(uid types.UID) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.mirrors[uid]; ok {
		return e.pod, true
	}
	return nil, false
}

// GetPodByName returns the non-mirror pod namespace/name.
func (ix *mIndex) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	return ix.GetPodByFullName(BuildPodFullName(name, namespace))
}

// GetPodByFullName returns the non-mirror pod with the full name.
func (ix *mIndex) GetPodByFullName(fullName string) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.podByFullNameLocked(fullName)
}

// GetMirrorPodByPod returns the mirror pod with pod's full name.
func (ix *mIndex) GetMirrorPodByPod(pod *v1.Pod) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.mirrorByFullNameLocked(PodFullName(pod))
}

// GetPodByMirrorPod returns the non-mirror pod with mirrorPod's full name.
func (ix *mIndex) GetPodByMirrorPod(mirrorPod *v1.Pod) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.podByFullNameLocked(PodFullName(mirrorPod))
}

// GetPodAndMirrorPod returns the complement of a pod: for a mirror pod, the pod with its full name (and
// wasMirror true); for another pod, the mirror pod with its full name.
func (ix *mIndex) GetPodAndMirrorPod(aPod *v1.Pod) (pod, mirrorPod *v1.Pod, wasMirror bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	fn := PodFullName(aPod)
	if IsMirrorPod(aPod) {
		p, _ := ix.podByFullNameLocked(fn)
		return p, aPod, true
	}
	m, _ := ix.mirrorByFullNameLocked(fn)
	return aPod, m, false
}

// TranslatePodUID returns the UID of the static pod of a mirror pod UID, else uid itself ("" stays "").
func (ix *mIndex) TranslatePodUID(uid types.UID) types.UID {
	if uid == "" {
		return uid
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if static, ok := ix.translateLocked(uid); ok {
		return static
	}
	return uid
}

// translateLocked maps a mirror pod UID to the UID of the non-mirror pod with its full name.
func (ix *mIndex) translateLocked(mirrorUID types.UID) (types.UID, bool) {
	m, ok := ix.mirrors[mirrorUID]
	if !ok {
		return "", false
	}
	p, ok := ix.podByFullNameLocked(PodFullName(m.pod))
	if !ok {
		return "", false
	}
	return p.UID, true
}

// GetUIDTranslations returns static pod UID -> mirror pod UID (an mEntry for every static pod, "" when it has
// no mirror) and mirror pod UID -> static pod UID.
func (ix *mIndex) GetUIDTranslations() (podToMirror, mirrorToPod map[types.UID]types.UID) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	podToMirror = make(map[types.UID]types.UID)
	mirrorToPod = make(map[types.UID]types.UID)
	for uid, e := range ix.pods {
		if IsStaticPod(e.pod) {
			podToMirror[uid] = ""
		}
	}
	// Mirrors in upsert order, so when two mirrors share a full name the mNewest one wins podToMirror, as the
	// kubelet's last write does.
	mirrors := make([]*mEntry, 0, len(ix.mirrors))
	for _, e := range ix.mirrors {
		mirrors = append(mirrors, e)
	}
	sort.Slice(mirrors, func(i, j int) bool { return mirrors[i].order < mirrors[j].order })
	for _, m := range mirrors {
		if static, ok := ix.translateLocked(m.pod.UID); ok {
			mirrorToPod[m.pod.UID] = static
			podToMirror[static] = m.pod.UID
		}
	}
	return podToMirror, mirrorToPod
}

// each calls fn for every pod (non-mirror and mirror) with its raw JSON and order, under the read lock.
func (ix *mIndex) each(fn func(e *mEntry, mirror bool)) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for _, e := range ix.pods {
		fn(e, false)
	}
	for _, e := range ix.mirrors {
		fn(e, true)
	}
}

// get returns the mEntry of uid (non-mirror or mirror).
func (ix *mIndex) get(uid types.UID) (*mEntry, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.pods[uid]; ok {
		return e, true
	}
	e, ok := ix.mirrors[uid]
	return e, ok
}

// mObjKey is one referenced object.
type mObjKey struct {
	kind, namespace, name string
}

// mPodNames is what a registered pod references.
type mPodNames struct {
	secrets, configMaps []string // de-duplicated, in visit order
}

func mReferencedNames(pod *v1.Pod) mPodNames {
	n := mPodNames{secrets: make([]string, 0, 4), configMaps: make([]string, 0, 4)}
	VisitPodSecretNames(pod, func(name string) bool {
		if !mContains(n.secrets, name) {
			n.secrets = append(n.secrets, name)
		}
		return true
	})
	VisitPodConfigmapNames(pod, func(name string) bool {
		if !mContains(n.configMaps, name) {
			n.configMaps = append(n.configMaps, name)
		}
		return true
	})
	return n
}

// contains is a linear search: a pod names a handful of objects, where a map would cost more.
func mContains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// mRegistry is the old Registry: registered pods
// keyed by (namespace, name, uid); the first registration of a key adds a reference for every name it
// references; a re-registration adds only names the previous version did not reference and drops only names
// it no longer references; unregistering drops every name of the stored version; an unknown pod is a no-op.
// An object's count is the number of registered pods referencing it. There is no API server here, so the
// TTL object store's fetching and caching have no counterpart: only the references are kept.
//
// mRegistry is safe for concurrent use.
type mRegistry struct {
	mu     sync.RWMutex
	pods   map[podRefKey]mPodNames
	counts map[mObjKey]int
}

// newMRegistry returns an empty registry.
func newMRegistry() *mRegistry {
	return &mRegistry{pods: make(map[podRefKey]mPodNames), counts: make(map[mObjKey]int)}
}

// RegisterPod registers pod's references and returns the objects whose count went 0 -> 1 or 1 -> 0.
func (r *mRegistry) RegisterPod(pod *v1.Pod) []Transition {
	names := mReferencedNames(pod)
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
func (r *mRegistry) UnregisterPod(pod *v1.Pod) []Transition {
	return r.unregisterKey(refKey(pod))
}

func (r *mRegistry) unregisterKey(key podRefKey) []Transition {
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

func (r *mRegistry) addAll(out []Transition, key podRefKey, kind string, names []string) []Transition {
	for _, n := range names {
		out = r.inc(out, key, kind, n)
	}
	return out
}

func (r *mRegistry) diff(out []Transition, key podRefKey, kind string, prev, next []string) []Transition {
	for _, n := range next {
		if !mContains(prev, n) {
			out = r.inc(out, key, kind, n)
		}
	}
	for _, n := range prev {
		if !mContains(next, n) {
			out = r.dec(out, key, kind, n)
		}
	}
	return out
}

func (r *mRegistry) inc(out []Transition, key podRefKey, kind, name string) []Transition {
	k := mObjKey{kind: kind, namespace: key.namespace, name: name}
	r.counts[k]++
	if r.counts[k] == 1 {
		out = append(out, Transition{Kind: kind, Namespace: key.namespace, Name: name, Registered: true, Pod: key})
	}
	return out
}

func (r *mRegistry) dec(out []Transition, key podRefKey, kind, name string) []Transition {
	k := mObjKey{kind: kind, namespace: key.namespace, name: name}
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
func (r *mRegistry) Count(kind, namespace, name string) int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.counts[mObjKey{kind: kind, namespace: namespace, name: name}]
}

// Registered reports whether the object is registered (the kubelet's GetObject would not answer
// "object ... not registered").
func (r *mRegistry) Registered(kind, namespace, name string) bool {
	return r.Count(kind, namespace, name) > 0
}

// IsPodRegistered reports whether pod's key is registered.
func (r *mRegistry) IsPodRegistered(pod *v1.Pod) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	_, ok := r.pods[refKey(pod)]
	return ok
}

// Refs lists every registered object with its count, sorted by kind, namespace and name.
func (r *mRegistry) Refs() []events.Ref {
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

// mState is one node's pod index and secret/configmap registration, driven by pod events. It is a function of
// the indexed pods (and the order of their upserts): applying the same events in the same order to two
// States gives equal States, and so does loading a snapshot then applying the events after it.
//
// Lock order: mState.mu, then mIndex.mu or mRegistry.mu (never both of those at once).
type mState struct {
	Index *mIndex
	Refs  *mRegistry

	// mu serialises Apply and guards applied and dirty.
	mu      sync.Mutex
	applied uint64
	// dirty are the pods changed since the last TakeDirty (true: present, false: deleted).
	dirty map[types.UID]bool
}

// newMState returns an empty state.
func newMState() *mState {
	return &mState{Index: newMIndex(), Refs: newMRegistry(), dirty: make(map[types.UID]bool)}
}

// Apply is the old State.Apply:
//   - added and updated upsert the pod (the kubelet's AddPod == UpdatePod). A non-mirror pod in a non-terminal
//     phase is registered (RegisterPod: only added and dropped names change counts); a terminal one is
//     unregistered. Mirror pods are indexed, never registered (the kubelet registers the static pod it syncs,
//     not its mirror).
//   - deleted removes the pod with that UID and unregisters it; an unknown pod is a no-op.
//
// A pod upserted under another namespace or name than its UID had is unregistered under the old key first.
func (s *mState) Apply(seq uint64, ev PodEvent) []Transition {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Transition
	pod := ev.Pod
	switch ev.Action {
	case events.ActionDeleted:
		removed := s.Index.remove(pod.UID)
		if removed != nil {
			out = append(out, s.Refs.UnregisterPod(removed)...)
		}
		if removed == nil || refKey(removed) != refKey(pod) {
			out = append(out, s.Refs.UnregisterPod(pod)...)
		}
		s.dirty[pod.UID] = false
	default:
		prev := s.Index.upsert(pod, ev.Raw, seq)
		if prev != nil && refKey(prev) != refKey(pod) {
			out = append(out, s.Refs.UnregisterPod(prev)...)
		}
		out = append(out, s.register(pod)...)
		s.dirty[pod.UID] = true
	}
	if seq > s.applied {
		s.applied = seq
	}
	return out
}

func (s *mState) register(pod *v1.Pod) []Transition {
	if IsMirrorPod(pod) || IsTerminal(pod) {
		return s.Refs.UnregisterPod(pod)
	}
	return s.Refs.RegisterPod(pod)
}

// Skip records that seq was handled without changing the state (a rejected event).
func (s *mState) Skip(seq uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq > s.applied {
		s.applied = seq
	}
}

// Applied is the stream sequence of the last event applied or skipped.
func (s *mState) Applied() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.applied
}

// InUseImages lists the image references named by the indexed pods that are not in a terminal phase: every
// init, regular and ephemeral container's image and every image volume's reference, de-duplicated and sorted.
func (s *mState) InUseImages() []string {
	set := make(map[string]struct{})
	add := func(ref string) {
		if ref != "" {
			set[ref] = struct{}{}
		}
	}
	s.Index.each(func(e *mEntry, _ bool) {
		if IsTerminal(e.pod) {
			return
		}
		spec := &e.pod.Spec
		for i := range spec.InitContainers {
			add(spec.InitContainers[i].Image)
		}
		for i := range spec.Containers {
			add(spec.Containers[i].Image)
		}
		for i := range spec.EphemeralContainers {
			add(spec.EphemeralContainers[i].Image)
		}
		for i := range spec.Volumes {
			if img := spec.Volumes[i].Image; img != nil {
				add(img.Reference)
			}
		}
	})
	out := make([]string, 0, len(set))
	for ref := range set {
		out = append(out, ref)
	}
	sort.Strings(out)
	return out
}

// mRecord is how a pod is kept in the snapshot.
type mRecord struct {
	Order uint64          `json:"order"`
	Pod   json.RawMessage `json:"pod"`
}

// mDirty is what changed since the last TakeDirty: pods to store (key: UID) and UIDs to delete, as of the
// stream sequence Applied.
type mDirty struct {
	Puts    map[types.UID][]byte
	Deletes []types.UID
	Applied uint64
}

// TakeDirty returns the changes since the last call and clears them.
func (s *mState) TakeDirty() (mDirty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := mDirty{Puts: make(map[types.UID][]byte), Applied: s.applied}
	for uid, present := range s.dirty {
		e, ok := s.Index.get(uid)
		if !present || !ok {
			d.Deletes = append(d.Deletes, uid)
			continue
		}
		raw := e.raw
		if raw == nil {
			var err error
			if raw, err = json.Marshal(e.pod); err != nil {
				return mDirty{}, fmt.Errorf("encode pod %s: %w", uid, err)
			}
		}
		buf := make([]byte, 0, len(raw)+40)
		buf = append(buf, `{"order":`...)
		buf = strconv.AppendUint(buf, e.order, 10)
		buf = append(buf, `,"pod":`...)
		buf = append(buf, raw...)
		buf = append(buf, '}')
		d.Puts[uid] = buf
	}
	clear(s.dirty)
	return d, nil
}

// Redirty marks the changes of d dirty again (their write failed), unless newer changes replaced them.
func (s *mState) Redirty(d mDirty) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid := range d.Puts {
		if _, ok := s.dirty[uid]; !ok {
			s.dirty[uid] = true
		}
	}
	for _, uid := range d.Deletes {
		if _, ok := s.dirty[uid]; !ok {
			s.dirty[uid] = false
		}
	}
}

// Load rebuilds the state from snapshot records (as TakeDirty encodes them) and the sequence they were
// taken at; pods are re-applied in the order of their upserts.
func (s *mState) Load(records [][]byte, applied uint64) error {
	type loaded struct {
		order uint64
		pod   *v1.Pod
		raw   []byte
	}
	list := make([]loaded, 0, len(records))
	for _, b := range records {
		var r mRecord
		if err := json.Unmarshal(b, &r); err != nil {
			return fmt.Errorf("decode pod mRecord: %w", err)
		}
		pod := &v1.Pod{}
		if err := json.Unmarshal(r.Pod, pod); err != nil {
			return fmt.Errorf("decode pod mRecord: %w", err)
		}
		list = append(list, loaded{order: r.Order, pod: pod, raw: r.Pod})
	}
	sort.Slice(list, func(i, j int) bool { return list[i].order < list[j].order })
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, l := range list {
		s.Index.upsert(l.pod, l.raw, l.order)
		s.register(l.pod)
	}
	s.applied = applied
	return nil
}
