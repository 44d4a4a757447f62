package podindex

import (
	"sort"
	"sync"

	"github.com/imagefleet/imagefleet/events"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Annotations the kubelet's pod manager reads, and the config sources: the pod event contract's, in events.
const (
	ConfigSourceAnnotationKey    = events.ConfigSourceAnnotationKey
	ConfigMirrorAnnotationKey    = events.ConfigMirrorAnnotationKey
	ConfigHashAnnotationKey      = events.ConfigHashAnnotationKey
	ConfigFirstSeenAnnotationKey = events.ConfigFirstSeenAnnotationKey
	ApiserverSource              = events.ApiserverSource
	FileSource                   = events.FileSource
)

// IsMirrorPod reports whether pod is a mirror pod (it has the config.mirror annotation), as the kubelet's
// kubetypes.IsMirrorPod.
func IsMirrorPod(pod *v1.Pod) bool {
	_, ok := pod.Annotations[ConfigMirrorAnnotationKey]
	return ok
}

// IsStaticPod reports whether pod is a static pod: its config.source annotation is present and not "api".
func IsStaticPod(pod *v1.Pod) bool {
	source, ok := pod.Annotations[ConfigSourceAnnotationKey]
	return ok && source != ApiserverSource
}

// PodFullName is the kubelet's full name of a pod: name + "_" + namespace.
func PodFullName(pod *v1.Pod) string { return buildPodFullName(pod.Name, pod.Namespace) }

// buildPodFullName is name + "_" + namespace.
func buildPodFullName(name, namespace string) string { return name + "_" + namespace }

// isMirrorPodOf reports whether mirrorPod is the mirror of pod: same name and namespace, and the mirror's
// config.mirror annotation equals the pod's config.hash annotation.
func isMirrorPodOf(mirrorPod, pod *v1.Pod) bool {
	if pod.Name != mirrorPod.Name || pod.Namespace != mirrorPod.Namespace {
		return false
	}
	hash, ok := mirrorPod.Annotations[ConfigMirrorAnnotationKey]
	if !ok {
		return false
	}
	return hash == pod.Annotations[ConfigHashAnnotationKey]
}

// entry is one indexed pod and the order of its last upsert (the stream sequence of the event that stored
// it, so the order survives a restart).
type entry struct {
	pod      *v1.Pod
	order    uint64
	raw      []byte // the pod's JSON as received (what the snapshot stores), nil when added in process
	fullName string // PodFullName(pod), kept so a removal builds no string
	nameLen  int    // len(pod.Name): fullName is name "_" namespace, so fullName and nameLen say both
	// sameName is the next entry of the same kind (mirror or not) with the same full name, in upsert order
	// of their first upsert, newest first.
	sameName *entry
	// removed is set when the entry leaves the index; dirty while State has it to write (guarded by
	// State.mu, not Index.mu).
	removed, dirty bool
	// reg is the pod's registration when State registered it last (guarded by State.mu; a hint that
	// Registry checks).
	reg *registration
}

// Index is the kubelet's pod manager (pkg/kubelet/pod.basicManager): non-mirror pods by UID and by full name,
// mirror pods by UID and by full name, and the mirror-to-static UID translation.
//
// Unlike the kubelet, the full-name maps and the translation are derived from the set of live pods and the
// order of their upserts, not kept as maps that each call patches. Every kubelet answer is the same in the
// kubelet's own test cases and whenever at most one pod and one mirror pod share a full name; the derived
// form fixes the quirks the patched maps have, and makes the index a function of its pods, so a snapshot
// plus a replay of the events after it gives back exactly the same index:
//   - removing a static pod drops its translation (the kubelet keeps a stale mirror -> static entry: W-F);
//   - removing a pod that shares its full name with a newer pod leaves the newer one findable by full name
//     (the kubelet deletes the full-name entry whoever it points to);
//   - a pod upserted again under another name or namespace leaves its old full name (the kubelet keeps the
//     old full-name entry pointing at it).
//
// Two pods (or two mirror pods) with one full name both stay indexed by UID until each is deleted, and the
// full name resolves to the one upserted last, as in the kubelet. The full-name maps hold the head of a
// short list (almost always one entry), so adding a pod allocates its entry and nothing else.
//
// Index is safe for concurrent use.
type Index struct {
	mu sync.RWMutex
	// next orders upserts made in process (addPod without a stream sequence).
	next             uint64
	pods             map[types.UID]*entry
	mirrors          map[types.UID]*entry
	podsByFullName   map[string]*entry
	mirrorByFullName map[string]*entry
}

// newIndex returns an empty index.
func newIndex() *Index {
	ix := &Index{}
	ix.reset()
	return ix
}

func (ix *Index) reset() {
	ix.pods = make(map[types.UID]*entry)
	ix.mirrors = make(map[types.UID]*entry)
	ix.podsByFullName = make(map[string]*entry)
	ix.mirrorByFullName = make(map[string]*entry)
}

// setPods replaces every pod with pods, as if each were added in order.
func (ix *Index) setPods(pods []*v1.Pod) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.reset()
	for _, p := range pods {
		ix.next++
		ix.upsertLocked(p, nil, ix.next)
	}
}

// addPod adds or updates pod (addPod and updatePod are the same upsert, as in the kubelet).
func (ix *Index) addPod(pod *v1.Pod) { ix.updatePod(pod) }

// updatePod adds or updates pod.
func (ix *Index) updatePod(pod *v1.Pod) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.next++
	ix.upsertLocked(pod, nil, ix.next)
}

// upsert stores pod with the order of its event; it returns the pod it replaced (same UID), if any, and the
// entry that now holds pod.
func (ix *Index) upsert(pod *v1.Pod, raw []byte, order uint64) (*v1.Pod, *entry) {
	prev, e, _ := ix.upsertPrepared(pod, raw, order, IsMirrorPod(pod), "")
	return prev, e
}

// upsertPrepared is upsert given IsMirrorPod(pod) and PodFullName(pod) ("": worked out when needed); it
// also reports whether the pod replaced one of the same UID, kind, name and namespace in place.
func (ix *Index) upsertPrepared(pod *v1.Pod, raw []byte, order uint64, mirror bool, fullName string) (*v1.Pod, *entry, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.next = max(ix.next, order)
	return ix.upsertNamed(pod, raw, order, mirror, fullName)
}

func (ix *Index) upsertLocked(pod *v1.Pod, raw []byte, order uint64) (*v1.Pod, *entry) {
	prev, e, _ := ix.upsertNamed(pod, raw, order, IsMirrorPod(pod), "")
	return prev, e
}

func (ix *Index) upsertNamed(pod *v1.Pod, raw []byte, order uint64, mirror bool, fullName string) (*v1.Pod, *entry, bool) {
	m, other := ix.pods, ix.mirrors
	if mirror {
		m, other = ix.mirrors, ix.pods
	}
	if fullName == "" {
		fullName = PodFullName(pod)
	}
	// A UID is in at most one of the two maps.
	var prev *v1.Pod
	if e, ok := m[pod.UID]; ok {
		if e.nameLen == len(pod.Name) && e.fullName == fullName {
			// The common update: same UID, same kind, same name and namespace (the same full name split at
			// the same place): replace in place, without reading the old pod.
			prev = e.pod
			e.pod, e.order, e.raw = pod, order, raw
			return prev, e, true
		}
		prev = ix.dropLocked(pod.UID, e, mirror)
	} else if e, ok := other[pod.UID]; ok {
		prev = ix.dropLocked(pod.UID, e, !mirror)
	}
	e := &entry{pod: pod, order: order, raw: raw, fullName: fullName, nameLen: len(pod.Name)}
	byName := ix.podsByFullName
	if mirror {
		byName = ix.mirrorByFullName
	}
	m[pod.UID] = e
	e.sameName = byName[e.fullName]
	byName[e.fullName] = e
	return prev, e, false
}

// removePod removes the pod with pod's UID (mirror or not); an unknown pod is a no-op.
func (ix *Index) removePod(pod *v1.Pod) { ix.remove(pod.UID) }

func (ix *Index) remove(uid types.UID) *v1.Pod {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if e, ok := ix.pods[uid]; ok {
		return ix.dropLocked(uid, e, false)
	}
	if e, ok := ix.mirrors[uid]; ok {
		return ix.dropLocked(uid, e, true)
	}
	return nil
}

// dropLocked removes e, the entry of uid in the pods (or mirrors) map, and returns its pod.
func (ix *Index) dropLocked(uid types.UID, e *entry, mirror bool) *v1.Pod {
	m, byName := ix.pods, ix.podsByFullName
	if mirror {
		m, byName = ix.mirrors, ix.mirrorByFullName
	}
	delete(m, uid)
	head := byName[e.fullName]
	switch {
	case head == e && e.sameName == nil:
		delete(byName, e.fullName)
	case head == e:
		byName[e.fullName] = e.sameName
	default:
		for p := head; p != nil; p = p.sameName {
			if p.sameName == e {
				p.sameName = e.sameName
				break
			}
		}
	}
	e.sameName, e.removed = nil, true
	return e.pod
}

// newest is the most recently upserted entry of the list from head (the first one inserted among equal
// orders, as a scan of the list in insertion order keeping the first maximum).
func newest(head *entry) *entry {
	var best *entry
	for e := head; e != nil; e = e.sameName {
		if best == nil || e.order >= best.order {
			best = e
		}
	}
	return best
}

func (ix *Index) podByFullNameLocked(fn string) (*v1.Pod, bool) {
	if e := newest(ix.podsByFullName[fn]); e != nil {
		return e.pod, true
	}
	return nil, false
}

func (ix *Index) mirrorByFullNameLocked(fn string) (*v1.Pod, bool) {
	if e := newest(ix.mirrorByFullName[fn]); e != nil {
		return e.pod, true
	}
	return nil, false
}

// getPods returns the non-mirror pods.
func (ix *Index) getPods() []*v1.Pod {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return entriesToPods(ix.pods)
}

func entriesToPods(m map[types.UID]*entry) []*v1.Pod {
	out := make([]*v1.Pod, 0, len(m))
	for _, e := range m {
		out = append(out, e.pod)
	}
	return out
}

// Len is the number of non-mirror and mirror pods.
func (ix *Index) size() (pods, mirrors int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.pods), len(ix.mirrors)
}

// GetPodsAndMirrorPods returns the pods, the mirror pods, and the full names of the orphaned mirror pods
// (mirror full names with no non-mirror pod of that full name; nil when there are none).
func (ix *Index) GetPodsAndMirrorPods() (pods, mirrorPods []*v1.Pod, orphanedMirrorPodFullNames []string) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	pods = entriesToPods(ix.pods)
	mirrorPods = entriesToPods(ix.mirrors)
	for fn := range ix.mirrorByFullName {
		if _, ok := ix.podsByFullName[fn]; !ok {
			orphanedMirrorPodFullNames = append(orphanedMirrorPodFullNames, fn)
		}
	}
	sort.Strings(orphanedMirrorPodFullNames)
	return pods, mirrorPods, orphanedMirrorPodFullNames
}

// getStaticPodToMirrorPodMap maps every static pod to its mirror pod (nil when it has none).
func (ix *Index) getStaticPodToMirrorPodMap() map[*v1.Pod]*v1.Pod {
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

// getPodByUID returns the non-mirror pod with uid.
func (ix *Index) getPodByUID(uid types.UID) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.pods[uid]; ok {
		return e.pod, true
	}
	return nil, false
}

// getMirrorPodByUID returns the mirror pod with uid.
func (ix *Index) getMirrorPodByUID(uid types.UID) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.mirrors[uid]; ok {
		return e.pod, true
	}
	return nil, false
}

// getPodByName returns the non-mirror pod namespace/name.
func (ix *Index) getPodByName(namespace, name string) (*v1.Pod, bool) {
	return ix.GetPodByFullName(buildPodFullName(name, namespace))
}

// GetPodByFullName returns the non-mirror pod with the full name.
func (ix *Index) GetPodByFullName(fullName string) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.podByFullNameLocked(fullName)
}

// getMirrorPodByPod returns the mirror pod with pod's full name.
func (ix *Index) getMirrorPodByPod(pod *v1.Pod) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.mirrorByFullNameLocked(PodFullName(pod))
}

// getPodByMirrorPod returns the non-mirror pod with mirrorPod's full name.
func (ix *Index) getPodByMirrorPod(mirrorPod *v1.Pod) (*v1.Pod, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.podByFullNameLocked(PodFullName(mirrorPod))
}

// getPodAndMirrorPod returns the complement of a pod: for a mirror pod, the pod with its full name (and
// wasMirror true); for another pod, the mirror pod with its full name.
func (ix *Index) getPodAndMirrorPod(aPod *v1.Pod) (pod, mirrorPod *v1.Pod, wasMirror bool) {
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

// translatePodUID returns the UID of the static pod of a mirror pod UID, else uid itself ("" stays "").
func (ix *Index) translatePodUID(uid types.UID) types.UID {
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
func (ix *Index) translateLocked(mirrorUID types.UID) (types.UID, bool) {
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

// GetUIDTranslations returns static pod UID -> mirror pod UID (an entry for every static pod, "" when it has
// no mirror) and mirror pod UID -> static pod UID.
func (ix *Index) GetUIDTranslations() (podToMirror, mirrorToPod map[types.UID]types.UID) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	podToMirror = make(map[types.UID]types.UID)
	mirrorToPod = make(map[types.UID]types.UID)
	for uid, e := range ix.pods {
		if IsStaticPod(e.pod) {
			podToMirror[uid] = ""
		}
	}
	// Mirrors in upsert order, so when two mirrors share a full name the newest one wins podToMirror, as the
	// kubelet's last write does.
	mirrors := make([]*entry, 0, len(ix.mirrors))
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
func (ix *Index) each(fn func(e *entry, mirror bool)) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for _, e := range ix.pods {
		fn(e, false)
	}
	for _, e := range ix.mirrors {
		fn(e, true)
	}
}

// get returns the entry of uid (non-mirror or mirror).
func (ix *Index) get(uid types.UID) (*entry, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e, ok := ix.pods[uid]; ok {
		return e, true
	}
	e, ok := ix.mirrors[uid]
	return e, ok
}

// rawOf is the JSON the index received for pod, when pod is still the indexed pod of its UID (read under
// the lock: an apply replaces an entry's pod and raw in place).
func (ix *Index) rawOf(p *v1.Pod) []byte {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	e, ok := ix.pods[p.UID]
	if !ok {
		e, ok = ix.mirrors[p.UID]
	}
	if ok && e.pod == p {
		return e.raw
	}
	return nil
}

func metaOf(namespace, name string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: namespace, Name: name}
}
