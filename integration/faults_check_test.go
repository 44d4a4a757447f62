package integration_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/podindex"
)

// The fault test's checks: the end state of the system against the ledger of what the clients did.

// faultStream is what the events stream holds for the node.
type faultStream struct {
	msgs int
	// copies counts the stored copies of each event id (Nats-Msg-Id: the ce-id header of every event).
	copies map[string]int
	// results counts the stored terminal pull events (pulled or failed) of each request id.
	results     map[string]int
	pulls       []events.Event // pulling, pulled and failed
	removed     []events.Event
	finished    []events.Event
	transitions map[string]int // faultTransitionKey -> stored copies
	// transitionEvents describes each stored registration event by its faultTransitionKey: stream sequence,
	// id, time and pod, for a failure's report.
	transitionEvents map[string][]string
}

func readFaultStream(ctx context.Context, b *bus.Bus, node string) (*faultStream, error) {
	s := &faultStream{copies: map[string]int{}, results: map[string]int{}, transitions: map[string]int{},
		transitionEvents: map[string][]string{}}
	podPrefix := events.EventSubject(node, events.EntityPod, "")
	var bad []string
	err := b.Read(ctx, events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		s.msgs++
		if strings.HasPrefix(m.Subject, podPrefix) {
			// Pod events carry a core/v1 Pod as body and their id in the CloudEvents header.
			s.copies[m.Header.Get(events.HeaderID)]++
			return nil
		}
		ev, err := events.DecodeEvent(m.Data)
		if err != nil {
			bad = append(bad, fmt.Sprintf("seq %d: %v", m.Seq, err))
			return nil
		}
		s.copies[ev.ID]++
		switch ev.Type {
		case events.TypeName(events.EntityPull, events.ActionPulling):
			s.pulls = append(s.pulls, ev)
		case events.TypeName(events.EntityPull, events.ActionPulled), events.TypeName(events.EntityPull, events.ActionFailed):
			var r events.PullResult
			if ev.DecodeData(&r) == nil {
				s.results[r.RequestID]++
			}
			s.pulls = append(s.pulls, ev)
		case events.TypeName(events.EntityImage, events.ActionRemoved):
			s.removed = append(s.removed, ev)
		case events.TypeName(events.EntityGC, events.ActionFinished):
			s.finished = append(s.finished, ev)
		case events.TypeName(events.EntitySecret, events.ActionRegistered), events.TypeName(events.EntitySecret, events.ActionUnregistered),
			events.TypeName(events.EntityConfigMap, events.ActionRegistered), events.TypeName(events.EntityConfigMap, events.ActionUnregistered):
			var rc events.RefChange
			if ev.DecodeData(&rc) == nil {
				registered := strings.HasSuffix(strings.TrimSuffix(ev.Type, ".v1"), "."+events.ActionRegistered)
				k := faultTransitionKey(rc.StreamSeq, rc.Kind, rc.Namespace, rc.Name, registered)
				s.transitions[k]++
				s.transitionEvents[k] = append(s.transitionEvents[k], fmt.Sprintf("events seq %d id %s at %s by pod %s (uid %s)",
					m.Seq, ev.ID, ev.Time.Format("15:04:05.000"), rc.PodName, rc.PodUID))
			}
		}
		return nil
	})
	if err == nil && len(bad) > 0 {
		err = fmt.Errorf("undecodable events: %s", strings.Join(bad, "; "))
	}
	return s, err
}

func faultTransitionKey(seq uint64, kind, ns, name string, registered bool) string {
	return fmt.Sprintf("%d %s %s/%s %v", seq, kind, ns, name, registered)
}

// duplicates is the number of stored copies beyond the first, over every event id.
func (s *faultStream) duplicates() int {
	n := 0
	for _, c := range s.copies {
		n += max(c-1, 0)
	}
	return n
}

// readJournal returns every event in the agent's journal (the active file and the rotated one). A torn last
// line (the agent was killed while writing it) was never published and is counted apart.
func readJournal(dataDir string) (evs []events.Event, torn int, err error) {
	for _, name := range []string{bus.JournalFile + ".1", bus.JournalFile} {
		f, err := os.Open(filepath.Join(dataDir, "journal", name))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), events.MaxMessageBytes+1024)
		var pendingBad int
		for sc.Scan() {
			ev, err := events.DecodeEvent(sc.Bytes())
			if err != nil {
				pendingBad++
				continue
			}
			torn += pendingBad // an unreadable line in the middle is not a torn last line
			pendingBad = 0
			evs = append(evs, ev)
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return nil, 0, err
		}
		torn += pendingBad
	}
	return evs, torn, nil
}

// faultExpected replays the acknowledged pod events, in stream order, into a fresh index: the state the
// node's index must have, and the registration transitions it must have published.
func faultExpected(ledger []faultPodEvent) (*podindex.State, map[string]int, error) {
	sorted := slices.Clone(ledger)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].seq < sorted[j].seq })
	st := podindex.NewState()
	want := map[string]int{}
	for i, e := range sorted {
		if i > 0 && sorted[i-1].seq == e.seq {
			return nil, nil, fmt.Errorf("pod events %s and %s were acked with the same sequence %d", sorted[i-1].id, e.id, e.seq)
		}
		h := map[string][]string{}
		for k, v := range e.msg.Header {
			h[k] = []string{v}
		}
		ev, err := podindex.DecodePodEvent(e.msg.Subject, h, e.msg.Data)
		if err != nil {
			return nil, nil, fmt.Errorf("pod event %s: %w", e.id, err)
		}
		for _, tr := range st.Apply(e.seq, ev) {
			want[faultTransitionKey(e.seq, tr.Kind, tr.Namespace, tr.Name, tr.Registered)]++
		}
	}
	return st, want, nil
}

// describePods is a comparable description of pods: uid, namespace/name, phase and revision.
func describePods(pods []*v1.Pod) []string {
	out := make([]string, 0, len(pods))
	for _, p := range pods {
		out = append(out, fmt.Sprintf("%s %s/%s %s rev=%s", p.UID, p.Namespace, p.Name, p.Status.Phase, p.Annotations["fault/rev"]))
	}
	sort.Strings(out)
	return out
}

func decodePods(raws []json.RawMessage) ([]*v1.Pod, error) {
	var out []*v1.Pod
	for _, raw := range raws {
		p := &v1.Pod{}
		if err := json.Unmarshal(raw, p); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// diffStrings lists what is only in want and only in got.
func diffStrings(want, got []string) (missing, extra []string) {
	w, g := map[string]int{}, map[string]int{}
	for _, s := range want {
		w[s]++
	}
	for _, s := range got {
		g[s]++
	}
	for s, n := range w {
		for range n - g[s] {
			missing = append(missing, s)
		}
	}
	for s, n := range g {
		for range n - w[s] {
			extra = append(extra, s)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	return missing, extra
}

// gcViolations finds images GC removed while a pod of the ledger named them: the pod was in the index
// (confirmed) before the pass started and its deletion was published only after the pass finished, so the
// executor's re-check must have seen it.
func gcViolations(finished []events.Event, pods []*faultRealPod) (removals int, bad []string) {
	for _, ev := range finished {
		var res events.GCResult
		if ev.DecodeData(&res) != nil || res.DryRun {
			continue
		}
		for _, rm := range res.Removed {
			if rm.Error != "" {
				continue
			}
			removals++
			for _, p := range pods {
				if p.imageID != rm.ID || p.appliedAt.IsZero() || !p.appliedAt.Before(res.Started) {
					continue
				}
				if p.deletedAt.IsZero() || p.deletedAt.After(ev.Time) {
					bad = append(bad, fmt.Sprintf("GC pass started %s (finished %s) removed %s (%s) while pod %s/%s named it (in the index since %s, deleted %s)",
						res.Started.Format(time.StampMilli), ev.Time.Format(time.StampMilli), rm.ID, rm.RepoTags, p.pod.Namespace, p.pod.Name,
						p.appliedAt.Format(time.StampMilli), fmtTime(p.deletedAt)))
				}
			}
		}
	}
	return removals, bad
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return t.Format(time.StampMilli)
}

// doubleRemovals finds an image removed twice with nothing that could have brought it back in between: a
// removal reported twice, a side effect done twice.
//
// What brings an image back is a pull of it that was in the runtime at some moment between the two removals.
// A pull request's window runs from its pulling event (stored once: a redelivered request's pulling event
// has the same id) or its result's runtime pull start (Finished less PullDuration), whichever is earlier, to
// its result's Finished; a request without a result is open-ended. A failed pull counts as well: containerd
// killed after it stored the image fails the call. The window must begin before the second removal and end
// after the first removal's RemoveImage call began, which is at most removeTimeout (the agent's
// --runtime-request-timeout) before its event.
func doubleRemovals(removed, pulls []events.Event, idOf map[string]string, removeTimeout time.Duration) []string {
	removals := map[string][]events.Event{}
	for _, ev := range removed {
		var r events.ImageRemoved
		if ev.DecodeData(&r) == nil {
			removals[r.ID] = append(removals[r.ID], ev)
		}
	}
	windows := pullWindows(pulls, idOf)
	var bad []string
	for id, rms := range removals {
		sort.Slice(rms, func(i, j int) bool { return rms[i].Time.Before(rms[j].Time) })
		for i := 1; i < len(rms); i++ {
			first, second := rms[i-1].Time, rms[i].Time
			back := slices.ContainsFunc(windows[id], func(w pullWindow) bool {
				return w.from.Before(second) && (w.to.IsZero() || w.to.After(first.Add(-removeTimeout)))
			})
			if !back {
				var seen []string
				for _, w := range windows[id] {
					seen = append(seen, w.String())
				}
				bad = append(bad, fmt.Sprintf("image %s removed at %s and again at %s with no pull between (events %s, %s); its pulls: %v",
					id, first.Format(time.StampMilli), second.Format(time.StampMilli), rms[i-1].ID, rms[i].ID, seen))
			}
		}
	}
	sort.Strings(bad)
	return bad
}

// pullWindow is the time one pull request may have had the image's pull in the runtime.
type pullWindow struct {
	request  string
	from, to time.Time // to is zero: no result
}

func (w pullWindow) String() string {
	return fmt.Sprintf("%s %s-%s", w.request, w.from.Format(time.StampMilli), fmtTime(w.to))
}

// pullWindows returns the pull windows of each image id, from the pull events (idOf maps references to ids).
// A request that reached the runtime has a pulling event, a pulled result, or a runtime pull time in its
// result; one that failed before (cancelled, backed off) has none of these, and no window.
func pullWindows(pulls []events.Event, idOf map[string]string) map[string][]pullWindow {
	byReq := map[string]*pullWindow{}
	image := map[string]string{}
	failedType := events.TypeName(events.EntityPull, events.ActionFailed)
	for _, ev := range pulls {
		var r events.PullResult
		if ev.DecodeData(&r) != nil {
			continue
		}
		if ev.Type == failedType && r.PullDuration.Duration == 0 && byReq[r.RequestID] == nil {
			continue // failed before any runtime pull (a pulling event comes before its result)
		}
		w := byReq[r.RequestID]
		if w == nil {
			w = &pullWindow{request: r.RequestID, from: ev.Time}
			byReq[r.RequestID] = w
			image[r.RequestID] = idOf[r.Image]
		}
		from := ev.Time
		if !r.Finished.IsZero() {
			from = r.Finished.Add(-r.PullDuration.Duration)
			if r.Finished.After(w.to) {
				w.to = r.Finished
			}
		}
		if from.Before(w.from) {
			w.from = from
		}
	}
	out := map[string][]pullWindow{}
	for req, w := range byReq {
		out[image[req]] = append(out[image[req]], *w)
	}
	return out
}

func TestDoubleRemovalsCountsEveryPullThatCouldBringTheImageBack(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 11, 26, 34, 0, time.UTC)
	const ref, id = "reg/app:1", "sha256:app"
	idOf := map[string]string{ref: id}
	event := func(action string, at time.Time, data any) events.Event {
		ev, err := events.New("n", events.EntityPull, action, data)
		if err != nil {
			t.Fatal(err)
		}
		ev.Time = at
		return ev
	}
	var removals []events.Event
	for _, at := range []time.Time{t0, t0.Add(3 * time.Second)} {
		ev, err := events.New("n", events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: id})
		if err != nil {
			t.Fatal(err)
		}
		ev.Time = at
		removals = append(removals, ev)
	}
	pulling := func(req string, at time.Time) events.Event {
		return event(events.ActionPulling, at, events.PullResult{RequestID: req, Image: ref})
	}
	result := func(action, req string, started, finished time.Time) events.Event {
		return event(action, finished, events.PullResult{RequestID: req, Image: ref, Finished: finished,
			PullDuration: events.Duration{Duration: finished.Sub(started)}})
	}
	for _, c := range []struct {
		name  string
		pulls []events.Event
		want  bool // reported twice
	}{
		{"no pull", nil, true},
		{"a pull that ended before the first removal's call", []events.Event{
			pulling("a", t0.Add(-20*time.Second)), result(events.ActionPulled, "a", t0.Add(-20*time.Second), t0.Add(-11*time.Second))}, true},
		{"a pull that began after the second removal", []events.Event{
			pulling("a", t0.Add(4*time.Second)), result(events.ActionPulled, "a", t0.Add(4*time.Second), t0.Add(5*time.Second))}, true},
		{"a pull of another image", []events.Event{
			event(events.ActionPulling, t0.Add(time.Second), events.PullResult{RequestID: "a", Image: "reg/other:1"})}, true},
		{"a pull between the removals", []events.Event{
			pulling("a", t0.Add(time.Second)), result(events.ActionPulled, "a", t0.Add(time.Second), t0.Add(2*time.Second))}, false},
		{"a redelivered request whose pulling event came long before and its result after both", []events.Event{
			pulling("a", t0.Add(-30*time.Second)), result(events.ActionPulled, "a", t0.Add(5*time.Second), t0.Add(6*time.Second))}, false},
		{"a failed pull across the first removal", []events.Event{
			pulling("a", t0.Add(-3*time.Second)), result(events.ActionFailed, "a", t0.Add(-3*time.Second), t0.Add(time.Second))}, false},
		{"a pull in flight at the end", []events.Event{pulling("a", t0.Add(-time.Minute))}, false},
		{"a request that failed before reaching the runtime", []events.Event{
			result(events.ActionFailed, "a", t0.Add(time.Second), t0.Add(time.Second))}, true},
	} {
		got := doubleRemovals(removals, c.pulls, idOf, 10*time.Second)
		if (len(got) > 0) != c.want {
			t.Errorf("%s: reported %v, want reported %v", c.name, got, c.want)
		}
	}
}
