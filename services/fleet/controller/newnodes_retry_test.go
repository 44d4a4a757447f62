package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	kevents "k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// fakeJoins stands in for the bus and the rollout engine: a rollout's start record and its node's outcome,
// by rollout id. A run records both, with the next scripted outcome, as the engine would; a run of a
// rollout whose outcome is recorded reports it as resumed, as the engine does.
type fakeJoins struct {
	mu       sync.Mutex
	rollouts map[string]*fakeRollout
	outcomes []string // the next runs' failures, in order ("": success; none left: success)
	runs     []string // the rollout ids run, in order
	probes   int      // start records read
	paused   func() bool
	ranPause bool          // a run started while the object was paused
	hold     chan struct{} // non-nil: a run waits for a receive from it before it ends
	lost     bool          // the nodes heartbeat no more
}

func (f *fakeJoins) alive(context.Context, string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return !f.lost, nil
}

type fakeRollout struct {
	started events.RolloutStarted
	result  *events.RolloutNodeResult
}

func newFakeJoins() *fakeJoins { return &fakeJoins{rollouts: map[string]*fakeRollout{}} }

// record stores rollout id as started at start, with node's outcome (failure "": success) unless atWork.
func (f *fakeJoins) record(id, node string, start time.Time, failure string, atWork bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := &fakeRollout{started: events.RolloutStarted{ID: id, Nodes: []string{node}, Time: start}}
	if !atWork {
		r.result = &events.RolloutNodeResult{Node: node, OK: failure == "", Error: failure, Duration: events.Duration{Duration: time.Second}}
	}
	f.rollouts[id] = r
}

func (f *fakeJoins) started(_ context.Context, id string) (*events.RolloutStarted, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.probes++
	if r := f.rollouts[id]; r != nil {
		s := r.started
		return &s, nil
	}
	return nil, nil
}

func (f *fakeJoins) load(_ context.Context, id string) (*events.RolloutStarted, map[string]events.RolloutClaim, map[string]events.RolloutNodeResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	results := map[string]events.RolloutNodeResult{}
	r := f.rollouts[id]
	if r == nil {
		return nil, nil, results, nil
	}
	if r.result != nil {
		results[r.result.Node] = *r.result
	}
	s := r.started
	return &s, nil, results, nil
}

func (f *fakeJoins) run(_ *keptObject, id, node, _ string) (events.RolloutNodeResult, error) {
	paused := f.paused != nil && f.paused()
	if f.hold != nil {
		<-f.hold
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ranPause = f.ranPause || paused
	f.runs = append(f.runs, id)
	r := f.rollouts[id]
	if r != nil && r.result != nil {
		nr := *r.result
		nr.Resumed = true
		return nr, nil
	}
	if r == nil {
		r = &fakeRollout{started: events.RolloutStarted{ID: id, Nodes: []string{node}, Time: time.Now()}}
		f.rollouts[id] = r
	}
	failure := ""
	if len(f.outcomes) > 0 {
		failure, f.outcomes = f.outcomes[0], f.outcomes[1:]
	}
	r.result = &events.RolloutNodeResult{Node: node, OK: failure == "", Error: failure}
	return *r.result, nil
}

func (f *fakeJoins) ran() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.runs)
}

// retryKeeper is testKeeper with joins that get to work, over f. It runs in a synctest bubble: time.Sleep
// moves the bubble's clock (no real time passes) and synctest.Wait returns once every goroutine is blocked.
func retryKeeper(t *testing.T, f *fakeJoins, objs ...client.Object) *keeper {
	t.Helper()
	k := testKeeper(t, objs...)
	k.sem = make(chan struct{}, maxJoinsAtWork)
	k.rollouts = f
	return k
}

// advance moves the bubble's clock by d and lets every goroutine run until it blocks.
func advance(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

// counts are ko's counters, read under the keeper's lock.
func counts(k *keeper, ko *keptObject) keptCounts {
	k.mu.Lock()
	defer k.mu.Unlock()
	return ko.countsLocked()
}

// recorded drains the keeper's recorded Events.
func recorded(k *keeper) []string {
	var got []string
	ch := k.rec.(*kevents.FakeRecorder).Events
	for {
		select {
		case e := <-ch:
			got = append(got, e)
		default:
			return got
		}
	}
}

func wantCounts(t *testing.T, c keptCounts, succeeded, failed int32, failedNodes []v1alpha1.NodeFailure) {
	t.Helper()
	if c.Succeeded != succeeded || c.Failed != failed || c.Active != 0 || c.Joined != 1 || c.Desired != 1 || !slices.Equal(c.FailedNodes, failedNodes) {
		t.Errorf("counts %+v, want succeeded %d, failed %d, failedNodes %v (joined, desired 1)", c, succeeded, failed, failedNodes)
	}
}

// A failed join is tried again 30 s after its failure, then 1 min, then 2 min: a rollout of its own each
// time. The node counts once, failed (with its latest reason) until an attempt succeeds, then succeeded; its
// taint goes then. A NodeFailed Event tells of the first failure and of each change of reason only.
func TestFailedJoinIsTriedAgainAfterItsBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable", "registry unreachable", "manifest unknown"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		id := func(attempt int) string { return JoinAttemptID(a.Status.RolloutID, "n", "uid-n", attempt) }

		k.consider(ko, "n", "")
		synctest.Wait()
		if got := f.ran(); !slices.Equal(got, []string{id(1)}) {
			t.Fatalf("ran %v, want the first attempt", got)
		}
		wantCounts(t, counts(k, ko), 0, 1, []v1alpha1.NodeFailure{{Node: "n", Reason: "registry unreachable"}})
		for _, step := range []struct {
			wait   time.Duration
			reason string // the failure listed after it ("": none)
		}{{30 * time.Second, "registry unreachable"}, {time.Minute, "manifest unknown"}, {2 * time.Minute, ""}} {
			n := len(f.ran())
			advance(step.wait - time.Second)
			if got := f.ran(); len(got) != n {
				t.Fatalf("ran %v before the backoff of %v passed", got, step.wait)
			}
			advance(time.Second)
			if got := f.ran(); len(got) != n+1 || got[n] != id(n+1) {
				t.Fatalf("ran %v, want attempt %d (%s) once the backoff of %v passed", got, n+1, id(n+1), step.wait)
			}
			if step.reason != "" {
				wantCounts(t, counts(k, ko), 0, 1, []v1alpha1.NodeFailure{{Node: "n", Reason: step.reason}})
				reconcileNode(t, k, "n")
				if !hasReadinessTaint(t, k.c, "n") {
					t.Fatal("the taint of a node whose attempts failed was removed")
				}
			}
		}
		wantCounts(t, counts(k, ko), 1, 0, nil)
		reconcileNode(t, k, "n")
		if hasReadinessTaint(t, k.c, "n") {
			t.Error("the taint stayed after an attempt warmed the node")
		}
		want := []string{
			fmt.Sprintf("Normal NodeJoined Node n joined: warming it (rollout %s)", id(1)),
			"Warning NodeFailed Node n: registry unreachable",
			fmt.Sprintf("Normal NodeJoined Node n joined: warming it (rollout %s, attempt 2)", id(2)),
			fmt.Sprintf("Normal NodeJoined Node n joined: warming it (rollout %s, attempt 3)", id(3)),
			"Warning NodeFailed Node n: manifest unknown (attempt 3)",
			fmt.Sprintf("Normal NodeJoined Node n joined: warming it (rollout %s, attempt 4)", id(4)),
		}
		var got []string
		for _, e := range recorded(k) {
			if !strings.Contains(e, "ImagesWarm") {
				got = append(got, e)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	})
}

// A controller that restarts finds a join's latest attempt on the bus and goes on from it: a failed one is
// tried again after its backoff from its end, one at work is resumed at once, a succeeded one is counted.
// No attempt runs twice.
func TestRestartedKeeperGoesOnFromTheLatestAttempt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		failed int    // attempts that failed before
		last   string // the latest attempt after them: "failed" (the last of failed), "at work", "succeeded"
		run    int    // the attempt run then (0: none)
	}{
		{"the latest failed", 5, "failed", 6},
		{"the latest at work", 2, "at work", 3},
		{"the latest succeeded", 1, "succeeded", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				a := keepNew("a", "")
				a.Status.FailedNodes = []v1alpha1.NodeFailure{{Node: "n", Reason: "registry unreachable"}} // as written before
				f := newFakeJoins()
				k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
				id := func(attempt int) string { return JoinAttemptID(a.Status.RolloutID, "n", "uid-n", attempt) }
				// The latest failure ended 7 min ago (its start and its 1 s): after 5 failures, its next
				// attempt is due in 1 min.
				last := time.Now().Add(-7*time.Minute - time.Second)
				for i := 1; i <= tc.failed; i++ {
					f.record(id(i), "n", last.Add(time.Duration(i-tc.failed)*time.Minute), "registry unreachable", false)
				}
				switch tc.last {
				case "at work":
					f.record(id(tc.failed+1), "n", last.Add(time.Minute), "", true)
				case "succeeded":
					f.record(id(tc.failed+1), "n", last.Add(time.Minute), "", false)
				}
				ko := follow(t, k, a, map[string]bool{})
				ko.failedNodes = slices.Clone(a.Status.FailedNodes)
				if err := k.adopt(ko, "n", "", true); err != nil {
					t.Fatal(err)
				}
				synctest.Wait()
				if tc.last == "failed" {
					if got := f.ran(); len(got) != 0 {
						t.Fatalf("ran %v before the backoff from the latest failure's end passed", got)
					}
					wantCounts(t, counts(k, ko), 0, 1, a.Status.FailedNodes)
					advance(time.Minute)
				}
				var want []string
				if tc.run > 0 {
					want = []string{id(tc.run)}
				}
				if got := f.ran(); !slices.Equal(got, want) {
					t.Fatalf("ran %v, want %v", got, want)
				}
				wantCounts(t, counts(k, ko), 1, 0, nil) // the fake's runs succeed
				advance(time.Hour)
				if got := f.ran(); !slices.Equal(got, want) {
					t.Errorf("ran %v after the join succeeded, want %v", got, want)
				}
			})
		})
	}
}

// The latest attempt is found in a number of start-record lookups logarithmic in it: 1, 2, 4 ... until one
// did not start, then halving the gap.
func TestLatestAttemptReadsFewRecords(t *testing.T) {
	for _, latest := range []int{0, 1, 2, 3, 7, 8, 9, 1000} {
		f := newFakeJoins()
		k := &keeper{rollouts: f}
		for i := 1; i <= latest; i++ {
			f.record(JoinAttemptID("pull-x", "n", "u", i), "n", time.Time{}, "x", false)
		}
		got, first, err := k.latestAttempt(t.Context(), "pull-x", "n", "u")
		if err != nil || got != latest || (first != nil) != (latest > 0) {
			t.Errorf("latest of %d: %d, first %v, %v", latest, got, first, err)
		}
		if bound := max(1, 2*bits.Len(uint(latest))); f.probes > bound { // 2*floor(log2(latest))+2
			t.Errorf("latest of %d: %d lookups, want at most %d", latest, f.probes, bound)
		}
	}
}

// A failed join is tried again at once when its node's agent starts again, without waiting for the backoff.
func TestAgentRestartRetriesAFailedJoinAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		advance(10 * time.Second) // the backoff is 30 s
		restarted(t, k, "n")
		synctest.Wait()
		want := []string{JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 1), JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 2)}
		if got := f.ran(); !slices.Equal(got, want) {
			t.Fatalf("ran %v, want %v: the second attempt at once", got, want)
		}
		wantCounts(t, counts(k, ko), 1, 0, nil)
	})
}

// An agent that starts again while an attempt is at work has the next attempt start at once if that one
// fails.
func TestAgentRestartDuringAnAttemptRetriesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable", "agent stopped"}
		f.hold = make(chan struct{})
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		f.hold <- struct{}{} // the first attempt fails
		advance(30 * time.Second)
		restarted(t, k, "n") // while the second is at work
		f.hold <- struct{}{} // the second fails
		synctest.Wait()
		failed := time.Now()
		f.hold <- struct{}{} // the third succeeds
		synctest.Wait()
		if d := time.Since(failed); d != 0 {
			t.Errorf("the third attempt started %v after the second failed, want at once", d)
		}
		want := []string{JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 1), JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 2),
			JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 3)}
		if got := f.ran(); !slices.Equal(got, want) {
			t.Fatalf("ran %v, want %v: the third attempt at once", got, want)
		}
		wantCounts(t, counts(k, ko), 1, 0, nil)
	})
}

// restarted hands the keeper node's last-seen record of an agent that started now.
func restarted(t *testing.T, k *keeper, node string) {
	t.Helper()
	v, err := json.Marshal(events.NodeInfo{Node: node, Started: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	k.registryEntry(bus.Entry{Key: node, Value: v}, false)
}

// A paused object holds a failed join's retry, past its backoff and across its agent's restart; the retry
// starts when the object resumes.
func TestPausedObjectHoldsRetries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		f.paused = func() bool {
			k.mu.Lock()
			defer k.mu.Unlock()
			return ko.paused
		}
		k.consider(ko, "n", "")
		synctest.Wait()
		paused := a.DeepCopy()
		paused.Spec.Paused = true
		k.observe(paused)
		advance(time.Hour)
		restarted(t, k, "n")
		synctest.Wait()
		if got := f.ran(); len(got) != 1 {
			t.Fatalf("ran %v while the object was paused, want the first attempt only", got)
		}
		wantCounts(t, counts(k, ko), 0, 1, []v1alpha1.NodeFailure{{Node: "n", Reason: "registry unreachable"}})
		k.observe(a) // resumed
		synctest.Wait()
		if got := f.ran(); len(got) != 2 || got[1] != JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 2) {
			t.Fatalf("ran %v, want the second attempt once the object resumed", got)
		}
		if f.ranPause {
			t.Error("an attempt ran while the object was paused")
		}
		wantCounts(t, counts(k, ko), 1, 0, nil)
	})
}

func TestJoinAttemptIDs(t *testing.T) {
	base := "pull-" + "0f8e5a2c-6d1b-4b7e-9a51-3c2d7e8f9a10"
	uid := types.UID("6b1f0e2a-9c3d-4e5f-8a7b-1c2d3e4f5a6b")
	long := strings.Repeat("n", 253)
	seen := map[string]bool{}
	for _, node := range []string{"node-a", long} {
		for _, u := range []types.UID{"", uid} {
			if JoinAttemptID(base, node, u, 1) != JoinRolloutID(base, node, u) {
				t.Errorf("attempt 1 of %s/%s: want the join's id", node, u)
			}
			for attempt := 1; attempt <= 50; attempt++ {
				id := JoinAttemptID(base, node, u, attempt)
				if err := events.ValidateRolloutID(id); err != nil {
					t.Errorf("attempt %d: %v", attempt, err)
				}
				if !strings.HasPrefix(id, base+"-join-") || len(id) != len(JoinRolloutID(base, node, u)) {
					t.Errorf("attempt %d: %s, want the join's form", attempt, id)
				}
				if seen[id] || id != JoinAttemptID(base, node, u, attempt) {
					t.Errorf("attempt %d: %s, want one id per attempt, the same each time", attempt, id)
				}
				seen[id] = true
			}
		}
	}
	want := []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 10 * time.Minute, 10 * time.Minute}
	for i, w := range want {
		if got := joinBackoff(i + 1); got != w {
			t.Errorf("backoff after attempt %d: %v, want %v", i+1, got, w)
		}
	}
	if got := joinBackoff(1 << 20); got != maxJoinRetry {
		t.Errorf("backoff after many attempts: %v", got)
	}
}

// A deleted object's failed join is tried no more: its retries end with it.
func TestForgottenObjectStopsItsRetries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		forgotten := time.Now()
		k.forget("a")
		k.wg.Wait() // the join's loop ends
		if d := time.Since(forgotten); d != 0 {
			t.Errorf("the join's loop ended %v after the object was let go, want at once", d)
		}
		advance(time.Hour)
		if got := f.ran(); len(got) != 1 {
			t.Errorf("ran %v, want the first attempt only", got)
		}
	})
}

// A failed join of a node that is lost (no heartbeat) is not tried while it stays lost: an attempt would only
// hold a slot for nodeTimeout. Its agent's start tries it at once.
func TestLostNodeRetriesWaitForItsAgent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"node did not answer"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		f.mu.Lock()
		f.lost = true
		f.mu.Unlock()
		advance(3 * time.Hour)
		first := []string{JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 1)}
		if got := f.ran(); !slices.Equal(got, first) {
			t.Fatalf("ran %v while the node was lost, want the first attempt only", got)
		}
		wantCounts(t, counts(k, ko), 0, 1, []v1alpha1.NodeFailure{{Node: "n", Reason: "node did not answer"}})
		f.mu.Lock()
		f.lost = false
		f.mu.Unlock()
		restarted(t, k, "n")
		synctest.Wait()
		want := append(first, JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 2))
		if got := f.ran(); !slices.Equal(got, want) {
			t.Fatalf("ran %v, want %v: the retry at once when its agent started", got, want)
		}
		wantCounts(t, counts(k, ko), 1, 0, nil)
	})
}

// A node relabelled out of the object's selection after its join failed is not tried again.
func TestUnselectedNodeIsNotTriedAgain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		a.Spec.Nodes.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"tier": "web"}}
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable"}
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		k.mu.Lock()
		k.nodes["n"] = registryNode{labels: labels.Set{"tier": "web"}}
		k.mu.Unlock()
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		k.mu.Lock()
		k.nodes["n"] = registryNode{labels: labels.Set{"tier": "db"}}
		k.mu.Unlock()
		advance(time.Hour)
		if got, want := f.ran(), []string{JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 1)}; !slices.Equal(got, want) {
			t.Fatalf("ran %v, want the first attempt only: the node is no longer selected", got)
		}
	})
}

// An agent that starts again during an attempt has the next one run at once even when the node's heartbeat
// key is not there yet (its start writes the last-seen record first).
func TestAgentRestartRetriesALostNodeAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a := keepNew("a", "")
		f := newFakeJoins()
		f.outcomes = []string{"registry unreachable", "agent stopped"}
		f.hold = make(chan struct{})
		f.lost = true
		k := retryKeeper(t, f, a, taintedNode("n", "uid-n", time.Now().Add(-time.Hour)))
		ko := follow(t, k, a, map[string]bool{})
		k.consider(ko, "n", "")
		synctest.Wait()
		restarted(t, k, "n") // during the first attempt
		f.hold <- struct{}{} // it fails
		synctest.Wait()
		select {
		case f.hold <- struct{}{}: // the second, run at once, fails
		case <-time.After(time.Hour): // the bubble's clock: no second attempt came
			t.Fatalf("no second attempt within an hour; ran %v", f.ran())
		}
		synctest.Wait()
		want := []string{JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 1), JoinAttemptID(a.Status.RolloutID, "n", "uid-n", 2)}
		if got := f.ran(); !slices.Equal(got, want) {
			t.Fatalf("ran %v, want %v: the second attempt at once", got, want)
		}
		close(f.hold)
	})
}
