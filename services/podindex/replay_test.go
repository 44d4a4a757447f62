package podindex

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// replayEvents is a churn like the fault test's: slots of pods whose names are reused by new UIDs, with
// changing secret references and phases.
func replayEvents(rng *rand.Rand, n int) []PodEvent {
	type slot struct {
		pod *v1.Pod
		gen int
	}
	slots := make([]slot, 6)
	var out []PodEvent
	for len(out) < n {
		k := rng.IntN(len(slots))
		s := &slots[k]
		action := events.ActionUpdated
		switch {
		case s.pod == nil:
			s.gen++
			s.pod = &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: fmt.Sprintf("idx-%d", k),
				UID: types.UID(fmt.Sprintf("idx-%d-%d", k, s.gen))}}
			action = events.ActionAdded
		case rng.IntN(5) == 0:
			action = events.ActionDeleted
		default:
			s.pod = s.pod.DeepCopy()
		}
		if action != events.ActionDeleted {
			c := v1.Container{Name: "c", Image: "img"}
			for range rng.IntN(3) {
				c.EnvFrom = append(c.EnvFrom, v1.EnvFromSource{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("s-%d", rng.IntN(4))}}})
			}
			s.pod.Spec = v1.PodSpec{Containers: []v1.Container{c}}
			s.pod.Status.Phase = v1.PodRunning
			if rng.IntN(8) == 0 {
				s.pod.Status.Phase = v1.PodSucceeded
			}
		}
		raw, _ := json.Marshal(s.pod)
		out = append(out, PodEvent{Action: action, Pod: s.pod.DeepCopy(), Raw: raw})
		if action == events.ActionDeleted {
			s.pod = nil
		}
	}
	return out
}

func transitionKeys(seq uint64, trs []Transition) []string {
	var out []string
	for _, t := range trs {
		out = append(out, fmt.Sprintf("%d %s %s/%s %v %s", seq, t.Kind, t.Namespace, t.Name, t.Registered, t.Pod.uid))
	}
	return out
}

// TestReplayAfterAPartialSnapshotWrite: a snapshot write stopped part way (some of the pods' puts and
// deletes of a flush landed, its applied sequence and position did not; before it, the flush confirmed the
// registration events through its applied sequence and said so) is loaded and every event after the last
// whole write replayed. The replay up to the confirmed sequence makes no transition (each was stored when
// first made; a replay onto newer pods makes others, under other ids), and from there on the transitions
// are the first application's, so each stored event has one id. Without the confirmed sequence, the replay
// makes transitions the first application did not.
func TestReplayAfterAPartialSnapshotWrite(t *testing.T) {
	differed := 0
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 1))
		evs := replayEvents(rng, 80)
		orig := NewState()
		kv := map[types.UID][]byte{}
		write := func(d snapshotDelta, keep func() bool) {
			for _, r := range d.Puts {
				if keep() {
					b, err := r.Encode()
					if err != nil {
						t.Fatal(err)
					}
					kv[r.UID] = b
				}
			}
			for _, uid := range d.Deletes {
				if keep() {
					delete(kv, uid)
				}
			}
		}
		p := uint64(10 + rng.IntN(20))  // the last whole write
		f := p + uint64(5+rng.IntN(20)) // the write cut short
		all := rng.IntN(4) == 0         // every put and delete landed, the sequences did not
		var first, after []string       // the first application's transitions in (p, f], and after f
		for i, ev := range evs {
			seq := uint64(i + 1)
			trs := transitionKeys(seq, orig.Apply(seq, ev))
			switch {
			case seq > f:
				after = append(after, trs...)
			case seq > p:
				first = append(first, trs...)
			}
			if seq == p || seq == f {
				d, err := orig.takeDirty()
				if err != nil {
					t.Fatal(err)
				}
				write(d, func() bool { return seq == p || all || rng.IntN(2) == 0 })
			}
		}
		records := make([][]byte, 0, len(kv))
		for _, b := range kv {
			records = append(records, b)
		}
		replay := func(confirmed uint64) (upTo, past []string) {
			st := NewState()
			if err := st.load(records, p, p, confirmed); err != nil {
				t.Fatal(err)
			}
			for i := p; i < uint64(len(evs)); i++ {
				trs := transitionKeys(i+1, st.Apply(i+1, evs[i]))
				if i+1 <= f {
					upTo = append(upTo, trs...)
				} else {
					past = append(past, trs...)
				}
			}
			return upTo, past
		}
		upTo, past := replay(f)
		if len(upTo) > 0 {
			t.Fatalf("seed %d (writes at %d and %d): the quiet replay made transitions %v", seed, p, f, upTo)
		}
		if only1, only2 := diffKeys(after, past); len(only1)+len(only2) > 0 {
			t.Fatalf("seed %d (writes at %d and %d): after the confirmed sequence the replay's transitions differ\nonly first: %v\nonly replay: %v",
				seed, p, f, only1, only2)
		}
		// The same replay without the confirmed sequence (a snapshot of an earlier release).
		upTo, _ = replay(0)
		if only1, only2 := diffKeys(first, upTo); len(only2) > 0 || len(only1) > 0 {
			differed++
		}
	}
	if differed == 0 {
		t.Errorf("no seed made a replay without the confirmed sequence differ: the check shows nothing")
	}
	t.Logf("without the confirmed sequence, %d of 300 replays made other transitions than the first application", differed)
}

func diffKeys(want, got []string) (only1, only2 []string) {
	w := map[string]int{}
	for _, s := range want {
		w[s]++
	}
	for _, s := range got {
		w[s]--
	}
	for s, n := range w {
		for ; n > 0; n-- {
			only1 = append(only1, s)
		}
		for ; n < 0; n++ {
			only2 = append(only2, s)
		}
	}
	return only1, only2
}
