package podindex

// This file is the reference model of TestModelEquivalence and TestIndexModelEquivalence: the pod index,
// the registration and the snapshot deltas written as plainly as they can be, a list of pods and a list of
// registrations scanned from start to end for every answer, sharing no code with the implementation but the
// kubelet's reference visitors (visitPodSecretNames, visitPodConfigmapNames, checked against the kubelet's
// fixtures in refs_test.go) and the result types. It is slow on purpose: a bug in the implementation's maps,
// chains, pointers or caches cannot hide in it.

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

func mIsMirror(p *v1.Pod) bool {
	_, ok := p.Annotations["kubernetes.io/config.mirror"]
	return ok
}

func mIsStatic(p *v1.Pod) bool {
	src, ok := p.Annotations["kubernetes.io/config.source"]
	return ok && src != "api"
}

func mFullName(p *v1.Pod) string { return p.Name + "_" + p.Namespace }

func mTerminal(p *v1.Pod) bool {
	return p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed
}

// mPod is one indexed pod: the pod, the order of its last upsert (its event's stream sequence), its JSON as
// received (nil when added in process).
type mPod struct {
	pod   *v1.Pod
	order uint64
	raw   []byte
}

// mIndex is the kubelet's pod manager as a list. A UID is indexed once (as a pod or a mirror pod); a full
// name resolves to the pod (or mirror pod) of that name upserted last; a mirror pod translates to the pod of
// its full name.
type mIndex struct {
	list []mPod
	next uint64 // orders the upserts made in process
}

func newMIndex() *mIndex { return &mIndex{} }

func (ix *mIndex) setPods(pods []*v1.Pod) {
	ix.list = nil
	for _, p := range pods {
		ix.addPod(p)
	}
}

func (ix *mIndex) addPod(pod *v1.Pod) { ix.updatePod(pod) }

func (ix *mIndex) updatePod(pod *v1.Pod) {
	ix.next++
	ix.upsert(pod, nil, ix.next)
}

// upsert replaces the pod with pod's UID, if any (returned), by pod.
func (ix *mIndex) upsert(pod *v1.Pod, raw []byte, order uint64) *v1.Pod {
	ix.next = max(ix.next, order)
	prev := ix.remove(pod.UID)
	ix.list = append(ix.list, mPod{pod: pod, order: order, raw: raw})
	return prev
}

// remove drops the pod with uid (returned; nil when there is none).
func (ix *mIndex) remove(uid types.UID) *v1.Pod {
	for i, e := range ix.list {
		if e.pod.UID == uid {
			ix.list = slices.Delete(ix.list, i, i+1)
			return e.pod
		}
	}
	return nil
}

func (ix *mIndex) removePod(pod *v1.Pod) { ix.remove(pod.UID) }

// find returns the pods (mirror: the mirror pods) for which match holds.
func (ix *mIndex) find(mirror bool, match func(p *v1.Pod) bool) []mPod {
	var out []mPod
	for _, e := range ix.list {
		if mIsMirror(e.pod) == mirror && match(e.pod) {
			out = append(out, e)
		}
	}
	return out
}

// byUID is the pod (mirror: mirror pod) with uid.
func (ix *mIndex) byUID(mirror bool, uid types.UID) (*v1.Pod, bool) {
	if found := ix.find(mirror, func(p *v1.Pod) bool { return p.UID == uid }); len(found) > 0 {
		return found[0].pod, true
	}
	return nil, false
}

// byFullName is the pod (mirror: mirror pod) of that full name upserted last.
func (ix *mIndex) byFullName(mirror bool, fn string) (*v1.Pod, bool) {
	var best *mPod
	for _, e := range ix.find(mirror, func(p *v1.Pod) bool { return mFullName(p) == fn }) {
		if best == nil || e.order >= best.order {
			best = &e
		}
	}
	if best == nil {
		return nil, false
	}
	return best.pod, true
}

func pods(list []mPod) []*v1.Pod {
	out := []*v1.Pod{}
	for _, e := range list {
		out = append(out, e.pod)
	}
	return out
}

func all(*v1.Pod) bool { return true }

func (ix *mIndex) size() (int, int) { return len(ix.find(false, all)), len(ix.find(true, all)) }

func (ix *mIndex) getPods() []*v1.Pod { return pods(ix.find(false, all)) }

func (ix *mIndex) GetPodsAndMirrorPods() ([]*v1.Pod, []*v1.Pod, []string) {
	var orphans []string
	for _, m := range ix.find(true, all) {
		if _, ok := ix.byFullName(false, mFullName(m.pod)); !ok && !slices.Contains(orphans, mFullName(m.pod)) {
			orphans = append(orphans, mFullName(m.pod))
		}
	}
	sort.Strings(orphans)
	return pods(ix.find(false, all)), pods(ix.find(true, all)), orphans
}

func (ix *mIndex) getStaticPodToMirrorPodMap() map[*v1.Pod]*v1.Pod {
	out := map[*v1.Pod]*v1.Pod{}
	for _, e := range ix.find(false, mIsStatic) {
		out[e.pod], _ = ix.byFullName(true, mFullName(e.pod))
	}
	return out
}

func (ix *mIndex) getPodByUID(uid types.UID) (*v1.Pod, bool)       { return ix.byUID(false, uid) }
func (ix *mIndex) getMirrorPodByUID(uid types.UID) (*v1.Pod, bool) { return ix.byUID(true, uid) }
func (ix *mIndex) getPodByName(ns, name string) (*v1.Pod, bool) {
	return ix.byFullName(false, name+"_"+ns)
}
func (ix *mIndex) GetPodByFullName(fn string) (*v1.Pod, bool) { return ix.byFullName(false, fn) }
func (ix *mIndex) getMirrorPodByPod(p *v1.Pod) (*v1.Pod, bool) {
	return ix.byFullName(true, mFullName(p))
}
func (ix *mIndex) getPodByMirrorPod(m *v1.Pod) (*v1.Pod, bool) {
	return ix.byFullName(false, mFullName(m))
}

func (ix *mIndex) getPodAndMirrorPod(p *v1.Pod) (*v1.Pod, *v1.Pod, bool) {
	if mIsMirror(p) {
		pod, _ := ix.byFullName(false, mFullName(p))
		return pod, p, true
	}
	mirror, _ := ix.byFullName(true, mFullName(p))
	return p, mirror, false
}

// translate is the pod of a mirror pod UID's full name.
func (ix *mIndex) translate(uid types.UID) (types.UID, bool) {
	m, ok := ix.byUID(true, uid)
	if !ok {
		return "", false
	}
	p, ok := ix.byFullName(false, mFullName(m))
	if !ok {
		return "", false
	}
	return p.UID, true
}

func (ix *mIndex) translatePodUID(uid types.UID) types.UID {
	if static, ok := ix.translate(uid); ok {
		return static
	}
	return uid
}

// GetUIDTranslations: every static pod maps to its mirror ("" without one); of two mirrors of one pod, the
// one upserted last wins.
func (ix *mIndex) GetUIDTranslations() (map[types.UID]types.UID, map[types.UID]types.UID) {
	podToMirror, mirrorToPod := map[types.UID]types.UID{}, map[types.UID]types.UID{}
	for _, e := range ix.find(false, mIsStatic) {
		podToMirror[e.pod.UID] = ""
	}
	mirrors := ix.find(true, all)
	sort.Slice(mirrors, func(i, j int) bool { return mirrors[i].order < mirrors[j].order })
	for _, m := range mirrors {
		if static, ok := ix.translate(m.pod.UID); ok {
			mirrorToPod[m.pod.UID], podToMirror[static] = static, m.pod.UID
		}
	}
	return podToMirror, mirrorToPod
}

// mReg is one registered pod key and the names its registered version references, by kind.
type mReg struct {
	key   podRefKey
	names map[string][]string // events.KindSecret, events.KindConfigMap -> names, in visit order
}

// mRegistry is the kubelet's cache-based managers' reference counting as a list of registrations: an
// object's count is the number of registrations naming it, counted when asked.
type mRegistry struct {
	regs []*mReg
}

var mKinds = []string{events.KindSecret, events.KindConfigMap}

func mKey(p *v1.Pod) podRefKey { return podRefKey{namespace: p.Namespace, name: p.Name, uid: p.UID} }

func mNames(p *v1.Pod) map[string][]string {
	out := map[string][]string{}
	add := func(kind string) func(string) bool {
		return func(n string) bool {
			if !slices.Contains(out[kind], n) {
				out[kind] = append(out[kind], n)
			}
			return true
		}
	}
	visitPodSecretNames(p, add(events.KindSecret))
	visitPodConfigmapNames(p, add(events.KindConfigMap))
	return out
}

func (r *mRegistry) Count(kind, ns, name string) int {
	n := 0
	for _, reg := range r.regs {
		if reg.key.namespace == ns && slices.Contains(reg.names[kind], name) {
			n++
		}
	}
	return n
}

func (r *mRegistry) lookup(key podRefKey) *mReg {
	for _, reg := range r.regs {
		if reg.key == key {
			return reg
		}
	}
	return nil
}

func (r *mRegistry) isPodRegistered(p *v1.Pod) bool { return r.lookup(mKey(p)) != nil }

// register: per kind, the names the pod's registered version lacked are added (in visit order; a count
// going 0 -> 1 is a transition), then the names it no longer references are dropped (1 -> 0, in the
// registered version's order).
func (r *mRegistry) register(p *v1.Pod) []Transition {
	key, next := mKey(p), mNames(p)
	reg := r.lookup(key)
	if reg == nil {
		reg = &mReg{key: key, names: map[string][]string{}}
		r.regs = append(r.regs, reg)
	}
	var out []Transition
	for _, kind := range mKinds {
		for _, n := range next[kind] {
			if !slices.Contains(reg.names[kind], n) {
				if r.Count(kind, key.namespace, n) == 0 {
					out = append(out, Transition{Kind: kind, Namespace: key.namespace, Name: n, Registered: true, Pod: key})
				}
				reg.names[kind] = append(reg.names[kind], n)
			}
		}
		for _, n := range slices.Clone(reg.names[kind]) {
			if !slices.Contains(next[kind], n) {
				reg.names[kind] = slices.DeleteFunc(reg.names[kind], func(x string) bool { return x == n })
				if r.Count(kind, key.namespace, n) == 0 {
					out = append(out, Transition{Kind: kind, Namespace: key.namespace, Name: n, Pod: key})
				}
			}
		}
		reg.names[kind] = slices.Clone(next[kind]) // the registered version's names, in its visit order
	}
	return out
}

// unregister drops the registration of p's key: each of its names whose count falls to 0 is a transition.
func (r *mRegistry) unregister(p *v1.Pod) []Transition {
	reg := r.lookup(mKey(p))
	if reg == nil {
		return nil
	}
	r.regs = slices.DeleteFunc(r.regs, func(x *mReg) bool { return x == reg })
	var out []Transition
	for _, kind := range mKinds {
		for _, n := range reg.names[kind] {
			if r.Count(kind, reg.key.namespace, n) == 0 {
				out = append(out, Transition{Kind: kind, Namespace: reg.key.namespace, Name: n, Pod: reg.key})
			}
		}
	}
	return out
}

// Refs: every object some registration names, with its count, by kind, namespace and name.
func (r *mRegistry) Refs() []events.Ref {
	out := []events.Ref{}
	for _, reg := range r.regs {
		for _, kind := range mKinds {
			for _, n := range reg.names[kind] {
				ref := events.Ref{Kind: kind, Namespace: reg.key.namespace, Name: n, Count: r.Count(kind, reg.key.namespace, n)}
				if !slices.Contains(out, ref) {
					out = append(out, ref)
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		return a.Kind < b.Kind || a.Kind == b.Kind && (a.Namespace < b.Namespace || a.Namespace == b.Namespace && a.Name < b.Name)
	})
	return out
}

// mState is a node's pod index driven by pod events, with the snapshot's dirty set.
type mState struct {
	Index   *mIndex
	Refs    *mRegistry
	applied uint64
	dirty   map[types.UID]bool // changed since the last takeDirty: true present, false deleted
}

func newMState() *mState {
	return &mState{Index: newMIndex(), Refs: &mRegistry{}, dirty: map[types.UID]bool{}}
}

// Apply: added and updated upsert the pod; a pod that had its UID under another key is unregistered under
// that key; then a non-mirror, non-terminal pod is registered, any other unregistered. deleted removes the
// pod with that UID and unregisters it, and the key of the body when it differs.
func (s *mState) Apply(seq uint64, ev PodEvent) []Transition {
	var out []Transition
	pod := ev.Pod
	if ev.Action == events.ActionDeleted {
		removed := s.Index.remove(pod.UID)
		if removed != nil {
			out = append(out, s.Refs.unregister(removed)...)
		}
		if removed == nil || mKey(removed) != mKey(pod) {
			out = append(out, s.Refs.unregister(pod)...)
		}
		s.dirty[pod.UID] = false
	} else {
		if prev := s.Index.upsert(pod, ev.Raw, seq); prev != nil && mKey(prev) != mKey(pod) {
			out = append(out, s.Refs.unregister(prev)...)
		}
		if mIsMirror(pod) || mTerminal(pod) {
			out = append(out, s.Refs.unregister(pod)...)
		} else {
			out = append(out, s.Refs.register(pod)...)
		}
		s.dirty[pod.UID] = true
	}
	s.skip(seq)
	return out
}

func (s *mState) skip(seq uint64) { s.applied = max(s.applied, seq) }

func (s *mState) Applied() uint64 { return s.applied }

// InUseImages: the images of every container and image volume of the non-terminal pods, sorted, once each.
func (s *mState) InUseImages() []string {
	out := []string{}
	add := func(ref string) {
		if ref != "" && !slices.Contains(out, ref) {
			out = append(out, ref)
		}
	}
	for _, e := range s.Index.list {
		if mTerminal(e.pod) {
			continue
		}
		for _, c := range e.pod.Spec.InitContainers {
			add(c.Image)
		}
		for _, c := range e.pod.Spec.Containers {
			add(c.Image)
		}
		for _, c := range e.pod.Spec.EphemeralContainers {
			add(c.Image)
		}
		for _, v := range e.pod.Spec.Volumes {
			if v.Image != nil {
				add(v.Image.Reference)
			}
		}
	}
	sort.Strings(out)
	return out
}

// mDirty is the snapshot delta: each changed pod's record ({"order":N,"pod":<JSON>}) and the UIDs to delete.
type mDirty struct {
	Puts    map[types.UID][]byte
	Deletes []types.UID
	Applied uint64
}

func (s *mState) takeDirty() (mDirty, error) {
	d := mDirty{Puts: map[types.UID][]byte{}, Applied: s.applied}
	for uid, present := range s.dirty {
		var e *mPod
		for i := range s.Index.list {
			if s.Index.list[i].pod.UID == uid {
				e = &s.Index.list[i]
			}
		}
		if !present || e == nil {
			d.Deletes = append(d.Deletes, uid)
			continue
		}
		raw := e.raw
		if raw == nil {
			var err error
			if raw, err = json.Marshal(e.pod); err != nil {
				return mDirty{}, err
			}
		}
		d.Puts[uid] = fmt.Appendf(nil, `{"order":%d,"pod":%s}`, e.order, raw)
	}
	s.dirty = map[types.UID]bool{}
	return d, nil
}

// redirty marks d's pods dirty again unless a newer change did.
func (s *mState) redirty(d mDirty) {
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
