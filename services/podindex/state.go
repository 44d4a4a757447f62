package podindex

import (
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// State is one node's pod index and secret/configmap registration, driven by pod events. It is a function of
// the indexed pods (and the order of their upserts): applying the same events in the same order to two
// States gives equal States, and so does loading a snapshot then applying the events after it.
//
// Lock order: State.mu, then Index.mu or Registry.mu (never both of those at once).
type State struct {
	Index *Index
	Refs  *Registry

	// mu serialises Apply and guards applied, dirty, deleted and the entries' dirty flags.
	mu      sync.Mutex
	applied uint64
	// pos is the IMAGEFLEET_PODS sequence of the last event handled (set after it was applied or skipped,
	// so it never runs ahead of applied); 0 before the first.
	pos uint64
	// dirty are the entries upserted since the last takeDirty (each once: entry.dirty), some since removed.
	// Updates of an entry already dirty cost nothing more.
	dirty []*entry
	// deleted are the UIDs deleted since the last takeDirty (repeats possible); a UID indexed again since
	// is stored instead.
	deleted []types.UID
	// quiet is the sequence through which the registration transitions are known stored though the
	// snapshot may not reflect it (0: none): a snapshot write that stopped part way leaves pods newer than
	// its applied sequence, and events replayed onto them would make transitions their first application
	// did not, under other ids. Events up to quiet make no transitions; once the index passes it, the
	// registrations are recomputed from the indexed pods (rebuildRefs), which the replay has brought to
	// what they were at quiet.
	quiet uint64
}

// NewState returns an empty state.
func NewState() *State {
	return &State{Index: newIndex(), Refs: newRegistry()}
}

// markDirty queues e for the next snapshot write.
func (s *State) markDirty(e *entry) {
	if !e.dirty {
		e.dirty = true
		s.dirty = append(s.dirty, e)
	}
}

// isTerminal reports whether pod is in a terminal phase (Succeeded or Failed): the kubelet unregisters it
// (SyncTerminatedPod) and image GC no longer needs its images.
func isTerminal(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}

// Apply applies one pod event with stream sequence seq and returns the objects whose reference count went
// 0 -> 1 or 1 -> 0, in order.
//
//   - added and updated upsert the pod (the kubelet's addPod == updatePod). A non-mirror pod in a non-terminal
//     phase is registered (registerPod: only added and dropped names change counts); a terminal one is
//     unregistered. Mirror pods are indexed, never registered (the kubelet registers the static pod it syncs,
//     not its mirror).
//   - deleted removes the pod with that UID and unregisters it; an unknown pod is a no-op.
//
// A pod upserted under another namespace or name than its UID had is unregistered under the old key first.
func (s *State) Apply(seq uint64, ev PodEvent) []Transition {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.quiet > 0 && seq > s.quiet {
		s.rebuildRefs()
	}
	out := s.applyLocked(seq, ev)
	if s.quiet > 0 {
		if seq == s.quiet {
			s.rebuildRefs()
		}
		return nil // stored when the event was first applied
	}
	return out
}

// rebuildRefs recomputes the registrations from the indexed pods, as load does, and ends the quiet replay.
func (s *State) rebuildRefs() {
	s.Refs.reset()
	s.Index.each(func(e *entry, _ bool) {
		e.reg = nil
		s.register(e.pod)
	})
	s.quiet = 0
}

func (s *State) applyLocked(seq uint64, ev PodEvent) []Transition {
	var out []Transition
	pod := ev.Pod
	switch ev.Action {
	case events.ActionDeleted:
		removed := s.Index.remove(pod.UID)
		if removed != nil {
			out = append(out, s.Refs.unregisterPod(removed)...)
		}
		if removed == nil || refKey(removed) != refKey(pod) {
			out = append(out, s.Refs.unregisterPod(pod)...)
		}
		s.deleted = append(s.deleted, pod.UID)
	default:
		var prev *v1.Pod
		var e *entry
		var inPlace bool // same UID, name and namespace: the same registration key
		if ev.prep.done {
			prev, e, inPlace = s.Index.upsertPrepared(pod, ev.Raw, seq, ev.prep.mirror, ev.prep.fullName)
		} else {
			prev, e = s.Index.upsert(pod, ev.Raw, seq)
		}
		if prev != nil && !inPlace && refKey(prev) != refKey(pod) {
			out = append(out, s.Refs.unregisterPod(prev)...)
		}
		if ev.prep.done {
			out = append(out, s.registerPrepared(e, &ev.prep)...)
		} else {
			out = append(out, s.registerEntry(e)...)
		}
		s.markDirty(e)
	}
	if seq > s.applied {
		s.applied = seq
	}
	return out
}

func (s *State) register(pod *v1.Pod) []Transition {
	if IsMirrorPod(pod) || isTerminal(pod) {
		return s.Refs.unregisterPod(pod)
	}
	return s.Refs.registerPod(pod)
}

// registerEntry is register for the pod of e, which keeps the pod's registration so that the next update
// of the pod does not look it up again.
func (s *State) registerEntry(e *entry) []Transition {
	if IsMirrorPod(e.pod) || isTerminal(e.pod) {
		e.reg = nil
		return s.Refs.unregisterPod(e.pod)
	}
	var out []Transition
	out, e.reg = s.Refs.register(e.pod, e.reg)
	return out
}

// registerPrepared is registerEntry with what prepare worked out of e's pod.
func (s *State) registerPrepared(e *entry, prep *prepared) []Transition {
	if prep.mirror || prep.terminal {
		e.reg = nil
		return s.Refs.unregisterPod(e.pod)
	}
	var out []Transition
	out, e.reg = s.Refs.registerNames(refKey(e.pod), prep.names[:prep.secrets], prep.names[prep.secrets:], e.reg)
	return out
}

// prepared is what Apply needs of an added or updated pod that depends on the pod alone. The decoders work
// it out (in parallel, while the pod they just decoded is in their cache), so the applier, which takes one
// event at a time, does only what depends on the state. Apply works it out itself for an event that does
// not have it (done unset).
type prepared struct {
	done             bool
	mirror, terminal bool
	fullName         string
	// names are the pod's secret names (the first secrets of them), then its configmap names, as
	// appendRefNames gives them; none for a mirror pod or a terminal one, which are not registered.
	names   []string
	secrets int
}

// set works out p for pod.
func (p *prepared) set(pod *v1.Pod) {
	p.done, p.mirror, p.terminal, p.fullName = true, IsMirrorPod(pod), isTerminal(pod), PodFullName(pod)
	if p.mirror || p.terminal {
		return
	}
	var scratch [16]string
	secrets, configMaps := appendRefNames(scratch[:0:8], scratch[8:8:16], pod)
	p.names = make([]string, 0, len(secrets)+len(configMaps))
	p.names = append(append(p.names, secrets...), configMaps...)
	p.secrets = len(secrets)
}

// Skip records that seq was handled without changing the state (a rejected event).
func (s *State) skip(seq uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq > s.applied {
		s.applied = seq
	}
	if s.quiet > 0 && seq >= s.quiet {
		s.rebuildRefs()
	}
}

// setPos records pos, the IMAGEFLEET_PODS sequence of the event just applied or skipped.
func (s *State) setPos(pos uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if pos > s.pos {
		s.pos = pos
	}
}

// Pos is the IMAGEFLEET_PODS sequence of the last event handled (0: none, or a snapshot of an older release,
// compat_events_positions.go).
func (s *State) Pos() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pos
}

// Applied is the stream sequence of the last event applied or skipped.
func (s *State) Applied() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.applied
}

// InUseImages lists the image references named by the indexed pods that are not in a terminal phase: every
// init, regular and ephemeral container's image and every image volume's reference, de-duplicated and sorted.
func (s *State) InUseImages() []string {
	set := make(map[string]struct{})
	add := func(ref string) {
		if ref != "" {
			set[ref] = struct{}{}
		}
	}
	s.Index.each(func(e *entry, _ bool) {
		if isTerminal(e.pod) {
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

// record is how a pod is kept in the snapshot.
type record struct {
	Order uint64          `json:"order"`
	Pod   json.RawMessage `json:"pod"`
}

// podRecord is one pod to write to the snapshot.
type podRecord struct {
	UID   types.UID
	Order uint64 // the stream sequence of its last upsert
	// Raw is the pod's JSON as received; when nil (a pod added in process), Pod is encoded.
	Raw []byte
	Pod *v1.Pod
}

// Encode is the record as the snapshot stores it: {"order":<Order>,"pod":<the pod's JSON>}.
func (r podRecord) Encode() ([]byte, error) {
	raw := r.Raw
	if raw == nil {
		var err error
		if raw, err = json.Marshal(r.Pod); err != nil {
			return nil, fmt.Errorf("encode pod %s: %w", r.UID, err)
		}
	}
	buf := make([]byte, 0, len(raw)+40)
	buf = append(buf, `{"order":`...)
	buf = strconv.AppendUint(buf, r.Order, 10)
	buf = append(buf, `,"pod":`...)
	buf = append(buf, raw...)
	return append(buf, '}'), nil
}

// snapshotDelta is what changed since the last takeDirty: pods to store (one record per UID) and UIDs to delete,
// as of the stream sequence Applied.
type snapshotDelta struct {
	Puts    []podRecord
	Deletes []types.UID
	Applied uint64
	Pos     uint64 // the IMAGEFLEET_PODS sequence of the event at Applied (0: not known)
}

// takeDirty returns the changes since the last call and clears them. It only collects them: encoding the
// records is left to the writer (Store.Write), outside the lock that Apply waits for.
func (s *State) takeDirty() (snapshotDelta, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := snapshotDelta{Puts: make([]podRecord, 0, len(s.dirty)), Applied: s.applied, Pos: s.pos}
	for _, e := range s.dirty {
		e.dirty = false
		if e.removed {
			continue // a later upsert of its UID is another entry; deleted lists a deletion
		}
		d.Puts = append(d.Puts, podRecord{UID: e.pod.UID, Order: e.order, Raw: e.raw, Pod: e.pod})
	}
	if len(s.deleted) > 0 {
		seen := make(map[types.UID]struct{}, len(s.deleted))
		for _, uid := range s.deleted {
			if _, dup := seen[uid]; dup {
				continue
			}
			seen[uid] = struct{}{}
			// A deleted UID that is indexed again was upserted after its deletion, so it is in Puts.
			if _, indexed := s.Index.get(uid); !indexed {
				d.Deletes = append(d.Deletes, uid)
			}
		}
	}
	clear(s.dirty)
	s.dirty = s.dirty[:0]
	s.deleted = s.deleted[:0]
	return d, nil
}

// redirty marks the changes of d dirty again (their write failed), unless newer changes replaced them.
func (s *State) redirty(d snapshotDelta) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range d.Puts {
		if e, ok := s.Index.get(r.UID); ok {
			s.markDirty(e) // a no-op when it changed since
		}
		// Not indexed any more: deleted since, and deleted lists it.
	}
	for _, uid := range d.Deletes {
		if _, ok := s.Index.get(uid); !ok {
			s.deleted = append(s.deleted, uid)
		}
		// Indexed again: upserted since, and dirty.
	}
}

// Load rebuilds the state from snapshot records (as takeDirty encodes them) and the sequence they were
// taken at; pods are re-applied in the order of their upserts.
//
// confirmed is the sequence through which the registration transitions were stored before the last
// snapshot write began (0: not known): past applied, that write stopped part way, and the replay up to it
// is quiet (State.quiet).
func (s *State) load(records [][]byte, applied, pos, confirmed uint64) error {
	type loaded struct {
		order uint64
		pod   *v1.Pod
		raw   []byte
	}
	list := make([]loaded, 0, len(records))
	for _, b := range records {
		var r record
		if err := json.Unmarshal(b, &r); err != nil {
			return fmt.Errorf("decode pod record: %w", err)
		}
		pod := &v1.Pod{}
		if err := json.Unmarshal(r.Pod, pod); err != nil {
			return fmt.Errorf("decode pod record: %w", err)
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
	s.applied, s.pos = applied, pos
	if confirmed > applied {
		s.quiet = confirmed
	}
	return nil
}
