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
	pulling     []events.Event
	pulled      []events.Event
	removed     []events.Event
	finished    []events.Event
	transitions map[string]int // faultTransitionKey -> stored copies
}

func readFaultStream(ctx context.Context, b *bus.Bus, node string) (*faultStream, error) {
	s := &faultStream{copies: map[string]int{}, results: map[string]int{}, transitions: map[string]int{}}
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
			s.pulling = append(s.pulling, ev)
		case events.TypeName(events.EntityPull, events.ActionPulled), events.TypeName(events.EntityPull, events.ActionFailed):
			var r events.PullResult
			if ev.DecodeData(&r) == nil {
				s.results[r.RequestID]++
			}
			if ev.Type == events.TypeName(events.EntityPull, events.ActionPulled) {
				s.pulled = append(s.pulled, ev)
			}
		case events.TypeName(events.EntityImage, events.ActionRemoved):
			s.removed = append(s.removed, ev)
		case events.TypeName(events.EntityGC, events.ActionFinished):
			s.finished = append(s.finished, ev)
		case events.TypeName(events.EntitySecret, events.ActionRegistered), events.TypeName(events.EntitySecret, events.ActionUnregistered),
			events.TypeName(events.EntityConfigMap, events.ActionRegistered), events.TypeName(events.EntityConfigMap, events.ActionUnregistered):
			var rc events.RefChange
			if ev.DecodeData(&rc) == nil {
				registered := strings.HasSuffix(strings.TrimSuffix(ev.Type, ".v1"), "."+events.ActionRegistered)
				s.transitions[faultTransitionKey(rc.StreamSeq, rc.Kind, rc.Namespace, rc.Name, registered)]++
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

// doubleRemovals finds an image removed twice with no pull of it in between: a removal reported twice, a
// side effect done twice. A pull is a pull.pulling event or a pull.pulled event (which name the image by
// reference): a pulled event of a real pull, or one saying the image was already present, which shows it was
// back (a pull the killed agent had in flight finished after the first removal; its redelivered request then
// found the image present, and its own pulling event had been stored under the same id before). A pull that
// began up to 2 s before the first removal counts too, since a pull racing a removal brings the image back
// after it.
func doubleRemovals(removed, pulling, pulled []events.Event, idOf map[string]string) []string {
	const slack = 2 * time.Second
	removals := map[string][]events.Event{}
	for _, ev := range removed {
		var r events.ImageRemoved
		if ev.DecodeData(&r) == nil {
			removals[r.ID] = append(removals[r.ID], ev)
		}
	}
	pulls := map[string][]time.Time{}
	for _, ev := range append(slices.Clone(pulling), pulled...) {
		var r events.PullResult
		if ev.DecodeData(&r) != nil {
			continue
		}
		pulls[idOf[r.Image]] = append(pulls[idOf[r.Image]], ev.Time)
	}
	var bad []string
	for id, rms := range removals {
		sort.Slice(rms, func(i, j int) bool { return rms[i].Time.Before(rms[j].Time) })
		for i := 1; i < len(rms); i++ {
			first, second := rms[i-1].Time, rms[i].Time
			if !slices.ContainsFunc(pulls[id], func(at time.Time) bool { return at.After(first.Add(-slack)) && at.Before(second) }) {
				bad = append(bad, fmt.Sprintf("image %s removed at %s and again at %s with no pull between (events %s, %s)",
					id, first.Format(time.StampMilli), second.Format(time.StampMilli), rms[i-1].ID, rms[i].ID))
			}
		}
	}
	sort.Strings(bad)
	return bad
}
