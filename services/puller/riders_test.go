package puller

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// joinedRequests publishes n requests for one image with policy Always, each for a pod of its own, and
// returns their ids.
func joinedRequests(t *testing.T, b *bus.Bus, n int) []string {
	t.Helper()
	var ids []string
	for i := range n {
		id := fmt.Sprintf("j%d", i)
		pod := &events.PodRef{Namespace: "ns", Name: fmt.Sprintf("pod-%d", i), UID: fmt.Sprintf("uid-j%d", i)}
		if err := publishPull(t, b, events.PullRequest{ID: id, Image: "shared:1", Policy: events.PullAlways, Pod: pod}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}

// pullConsumer is the node's pull consumer's state.
func pullConsumer(t *testing.T, b *bus.Bus) bus.ConsumerState {
	t.Helper()
	st, err := b.Consumer(t.Context(), events.PullStreamOf(testNode), events.PullerDurable(testNode))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// allDelivered waits until every request has left the queue's waiting list and only the pull's leader holds
// a token: the requests that joined its pull gave theirs back. It waits in a subtest, whose failure fails the
// test without stopping it, so that a test can still count the runtime pulls that follow.
func allDelivered(t *testing.T, b *bus.Bus) {
	t.Helper()
	t.Run("all delivered", func(t *testing.T) {
		bustest.Eventually(t, "every request delivered and one token held", bustest.Timeout, func() error {
			st, err := b.Consumer(t.Context(), events.PullStreamOf(testNode), events.PullerDurable(testNode))
			if err != nil {
				t.Fatal(err)
			}
			if st.NumPending == 0 && st.NumAckPending == 1 {
				return nil
			}
			return fmt.Errorf("during the pull: %d requests waiting for a token, %d tokens held; want 0 waiting and 1 held", st.NumPending, st.NumAckPending)
		})
	})
}

// checkJoinedResults checks that each request got its Pulling event and one Pulled result, one of them the
// pull's and the others shared.
func checkJoinedResults(t *testing.T, sub *bus.Subscription, ids []string, takenOver bool) {
	t.Helper()
	seen := map[string][]events.Event{}
	results := map[string]events.PullResult{}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for len(results) < len(ids) {
		ev, r, err := nextPullEvent(t, ctx, sub)
		if err != nil {
			t.Fatalf("waiting for results: %v (have %d of %d)", err, len(results), len(ids))
		}
		seen[r.RequestID] = append(seen[r.RequestID], ev)
		if ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
			if _, dup := results[r.RequestID]; dup {
				t.Errorf("two results for %s", r.RequestID)
			}
			results[r.RequestID] = r
		}
	}
	shared := 0
	for _, id := range ids {
		r, evs := results[id], seen[id]
		last := evs[len(evs)-1]
		if last.Reason != ReasonPulled || r.Error != "" || !r.Pulled || r.ImageRef == "" {
			t.Errorf("%s: %s %+v", id, last.Reason, r)
		}
		// A request taken over publishes its Pulling event again (same id: the events stream keeps one, a
		// core subscriber sees both).
		if len(evs) < 2 || evs[0].Reason != ReasonPulling || evs[0].Message != `Pulling image "shared:1"` ||
			(len(evs) > 2 && !takenOver) {
			t.Errorf("%s: %d events, want Pulling then Pulled", id, len(evs))
		}
		if r.Shared {
			shared++
		}
	}
	if shared != len(ids)-1 {
		t.Errorf("%d of %d results shared another's pull, want all but one", shared, len(ids))
	}
}

// TestJoinedRequestsHoldNoToken: five requests for one image with three tokens make one runtime pull. The
// first starts it; the others join it and give their token back while they wait, so the fourth and fifth
// are delivered during the pull and join it too, instead of waiting behind the joined ones for tokens and
// pulling again once it is over (policy Always). Each still gets its own Pulling event and result.
func TestJoinedRequestsHoldNoToken(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	s, _ := startService(t, b, rt, Config{MaxParallelImagePulls: ptr(int32(3))})
	sub := subscribePull(t, b)
	ids := joinedRequests(t, b, 5)

	bustest.WaitFor(t, "the runtime pull", func() bool { return rt.inFlight.Load() == 1 })
	allDelivered(t, b)
	if got := s.InFlight(); got != 5 {
		t.Errorf("%d requests in progress, want 5", got)
	}
	// End the pull; any later pull (a request that did not join) runs at once.
	rt.mu.Lock()
	rt.block = false
	rt.mu.Unlock()
	rt.release <- nil
	checkJoinedResults(t, sub, ids, false)
	if got := rt.pulls.Load(); got != 1 {
		t.Errorf("%d runtime pulls for five requests of one image, want 1", got)
	}
	bustest.WaitFor(t, "no request in progress", func() bool { return s.InFlight() == 0 })
	bustest.WaitFor(t, "the queue empty and every token back", func() bool {
		st := pullConsumer(t, b)
		return st.NumPending == 0 && st.NumAckPending == 0
	})
	noRiders(t, b, ids)
}

// noRiders checks that no riders record is left on the messages of ids.
func noRiders(t *testing.T, b *bus.Bus, ids []string) {
	t.Helper()
	rs, err := openKVRecords(t.Context(), b, testNode)
	if err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "the riders records removed", bustest.Timeout, func() error {
		for _, id := range ids {
			got, err := rs.Riders(t.Context(), id)
			if err != nil {
				return err
			}
			if len(got) != 0 {
				return fmt.Errorf("%d riders left on %s", len(got), id)
			}
		}
		return nil
	})
}

// resumed waits until the puller that took over runs all five requests on one runtime pull (one started
// it, four joined it), then ends it.
func resumed(t *testing.T, b *bus.Bus, s *Service, rt *fakeImages) {
	t.Helper()
	bustest.WaitFor(t, "five requests on one pull", func() bool {
		return rt.inFlight.Load() == 1 && testutil.ToFloat64(s.m.metrics.shared) == 4
	})
	if st := pullConsumer(t, b); st.NumPending != 0 || st.NumAckPending != 1 {
		t.Errorf("after the take-over: %d requests waiting, %d tokens held; want 0 and 1", st.NumPending, st.NumAckPending)
	}
	rt.mu.Lock()
	rt.block = false
	rt.mu.Unlock()
	rt.release <- nil
}

// TestJoinedRequestsSurviveStop: a puller stopped while four requests wait for the pull a fifth started
// loses none: the leader's request is handed back, and the puller that takes it runs the four recorded as
// riding on it, with one runtime pull.
func TestJoinedRequestsSurviveStop(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	cfg := Config{MaxParallelImagePulls: ptr(int32(3)), Registerer: prometheus.NewRegistry()}
	_, stop := startService(t, b, rt, cfg)
	sub := subscribePull(t, b)
	ids := joinedRequests(t, b, 5)
	bustest.WaitFor(t, "the runtime pull", func() bool { return rt.inFlight.Load() == 1 })
	allDelivered(t, b)
	stop()

	rt2 := newFakeImages()
	rt2.block = true
	cfg.Registerer = prometheus.NewRegistry()
	s2, _ := startService(t, b, rt2, cfg)
	resumed(t, b, s2, rt2)
	checkJoinedResults(t, sub, ids, true)
	if got := rt2.pulls.Load(); got != 1 {
		t.Errorf("the second puller made %d runtime pulls, want 1", got)
	}
	bustest.WaitFor(t, "no request in progress", func() bool { return s2.InFlight() == 0 })
	noRiders(t, b, ids)
}

// TestJoinedRequestsSurviveCrash: a puller whose connection dies while four requests wait for the pull a
// fifth started (a crash, for the server) loses none: after AckWait the leader's request goes to another
// replica, which runs the four recorded as riding on it.
func TestJoinedRequestsSurviveCrash(t *testing.T) {
	srv := bustest.Server(t)
	b := bustest.Connect(t, srv)
	b1 := bustest.Connect(t, srv)
	rt1 := newFakeImages()
	rt1.block = true
	cfg := Config{MaxParallelImagePulls: ptr(int32(3)), AckWait: time.Second, Registerer: prometheus.NewRegistry()}
	startService(t, b1, rt1, cfg)
	sub := subscribePull(t, b)
	ids := joinedRequests(t, b, 5)
	bustest.WaitFor(t, "the runtime pull", func() bool { return rt1.inFlight.Load() == 1 })
	allDelivered(t, b)
	b1.Close() // no ack, no progress, nothing more written

	rt2 := newFakeImages()
	rt2.block = true
	cfg.Registerer = prometheus.NewRegistry()
	s2, _ := startService(t, b, rt2, cfg)
	resumed(t, b, s2, rt2)
	checkJoinedResults(t, sub, ids, true)
	if got := rt2.pulls.Load(); got != 1 {
		t.Errorf("the second puller made %d runtime pulls, want 1", got)
	}
	noRiders(t, b, ids)
	for range 5 {
		rt1.release <- context.Canceled
	}
}

// TestCancelledLeaderKeepsToken: the request that started a pull is cancelled while four others ride on it.
// It gets its cancelled result at once, but its message (the pull's token) stays unacked while the pull
// runs on for the others; a rider cancelled meanwhile gets its own cancelled result; the rest share the
// one runtime pull.
func TestCancelledLeaderKeepsToken(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	s, _ := startService(t, b, rt, Config{MaxParallelImagePulls: ptr(int32(3))})
	sub := subscribePull(t, b)
	pod := func(i int) *events.PodRef {
		return &events.PodRef{Namespace: "ns", Name: fmt.Sprintf("pod-%d", i), UID: fmt.Sprintf("uid-j%d", i)}
	}
	if err := publishPull(t, b, events.PullRequest{ID: "j0", Image: "shared:1", Policy: events.PullAlways, Pod: pod(0)}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "j0's runtime pull", func() bool { return rt.inFlight.Load() == 1 })
	for i := 1; i < 5; i++ {
		if err := publishPull(t, b, events.PullRequest{ID: fmt.Sprintf("j%d", i), Image: "shared:1", Policy: events.PullAlways, Pod: pod(i)}); err != nil {
			t.Fatal(err)
		}
	}
	allDelivered(t, b)
	bustest.WaitFor(t, "five requests in progress", func() bool { return s.InFlight() == 5 })

	cancel := func(id string) {
		t.Helper()
		data, _ := json.Marshal(events.PullCancel{RequestID: id})
		if err := b.PublishRaw(events.CommandSubject(testNode, events.VerbPullCancel), data); err != nil {
			t.Fatal(err)
		}
	}
	cancel("j0")
	if _, r, _ := nextResult(t, sub, "j0", 10*time.Second); !r.Cancelled {
		t.Fatalf("cancelled leader: %+v", r)
	}
	cancel("j3")
	if _, r, _ := nextResult(t, sub, "j3", 10*time.Second); !r.Cancelled || !r.Shared {
		t.Fatalf("cancelled rider: %+v", r)
	}
	bustest.WaitFor(t, "three requests in progress", func() bool { return s.InFlight() == 3 })
	if rt.inFlight.Load() != 1 {
		t.Fatal("the runtime pull stopped while requests still wait for it")
	}
	if st := pullConsumer(t, b); st.NumAckPending != 1 {
		t.Errorf("%d tokens held while the pull runs, want the cancelled leader's 1", st.NumAckPending)
	}

	rt.release <- nil
	for id, r := range collectResults(t, sub, []string{"j1", "j2", "j4"}, 10*time.Second) {
		if r.Error != "" || !r.Pulled || !r.Shared {
			t.Errorf("%s: %+v", id, r)
		}
	}
	if got := rt.pulls.Load(); got != 1 {
		t.Errorf("%d runtime pulls, want 1", got)
	}
	bustest.WaitFor(t, "every token back", func() bool {
		st := pullConsumer(t, b)
		return st.NumPending == 0 && st.NumAckPending == 0
	})
	noRiders(t, b, []string{"j0"})
}
