package fleet

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestPullWatchKeepsOnlyItsOwnResults: a result no waiter wants yet is kept only when it is one of the
// rollout's requests; the other pulls of the fleet (the kubelet's, another rollout's) pass by, so the
// watch's memory does not grow with the fleet's pulls during a long rollout.
func TestPullWatchKeepsOnlyItsOwnResults(t *testing.T) {
	w := &PullWatch{rolloutID: "pull-1", results: map[string]events.PullResult{}, waiters: map[string]chan events.PullResult{}}
	own := PullRequestID("pull-1", "node-a")
	w.deliver(events.PullResult{RequestID: own})
	w.deliver(events.PullResult{RequestID: "pod-uid-123/nginx"})
	w.deliver(events.PullResult{RequestID: PullRequestID("pull-10", "node-a")})
	if len(w.results) != 1 {
		t.Fatalf("kept %d results (%v), want only %s", len(w.results), w.results, own)
	}
	select {
	case r := <-w.wait(own):
		if r.RequestID != own {
			t.Fatalf("got %q", r.RequestID)
		}
	default:
		t.Fatal("the kept result was not handed to its waiter")
	}
}

// TestPullWatchWithdrawsARequestItCouldNotConfirm: a pull request whose publish is never confirmed (here:
// no stream takes it, until the node timeout) may still have been stored, its ack lost; the node is counted
// failed, so the request is withdrawn (pullcancel) as after a timeout, and its waiter forgotten.
func TestPullWatchWithdrawsARequestItCouldNotConfirm(t *testing.T) {
	srv := bustest.Server(t)
	b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{Name: t.Name()}) // no streams: nothing confirms
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	cancels, err := b.SubscribeSync(t.Context(), events.CommandSubject("node-a", events.VerbPullCancel))
	if err != nil {
		t.Fatal(err)
	}
	w := &PullWatch{b: b, rolloutID: "pull-1", image: "busybox", results: map[string]events.PullResult{}, waiters: map[string]chan events.PullResult{}}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	nr := w.Action()(ctx, "node-a")
	if nr.OK {
		t.Fatalf("result %+v, want a failure", nr)
	}
	defer cancels.Close()
	nctx, ncancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer ncancel()
	_, data, err := cancels.Next(nctx)
	if err != nil {
		t.Fatalf("no pullcancel: %v", err)
	}
	var pc events.PullCancel
	if err := json.Unmarshal(data, &pc); err != nil || pc.RequestID != PullRequestID("pull-1", "node-a") {
		t.Fatalf("pullcancel %s (%v)", data, err)
	}
	if len(w.waiters) != 0 {
		t.Errorf("%d waiters left", len(w.waiters))
	}
}

// TestPullWatchNudgeRestartsAStaleFollower: a lookup that finds a result the follower has not reached makes
// the follower anew only when it has read nothing for followerStale, once per stale period.
func TestPullWatchNudgeRestartsAStaleFollower(t *testing.T) {
	restarts := 0
	w := &PullWatch{restart: func() { restarts++ }, next: 10, progress: time.Now().Add(-3 * time.Second)}
	w.nudge(9) // already read
	if restarts != 0 {
		t.Fatalf("restarted for a result the follower has read")
	}
	w.nudge(10)
	if restarts != 1 {
		t.Fatalf("%d restarts for a stale follower behind the result, want 1", restarts)
	}
	w.nudge(11) // at once again: the restart just made is given its time
	if restarts != 1 {
		t.Fatalf("%d restarts, want 1 per stale period", restarts)
	}
	w.progress = time.Now().Add(-time.Second) // read a second ago: not stale
	w.nudge(11)
	if restarts != 1 {
		t.Fatalf("%d restarts of a follower that read a second ago", restarts)
	}
}

// TestPullWatchFollowerRestartedReadsOn: a follower made anew by nudge reads on from where it was: a result
// published after the restart reaches its waiter through the follower, not a lookup.
func TestPullWatchFollowerRestartedReadsOn(t *testing.T) {
	_, b := bustest.Start(t)
	w, err := StartPullWatch(t.Context(), b, "pull-1", "busybox", "", WithNodeDomains(nil))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	publish := func(node string) {
		t.Helper()
		ev, err := events.New(node, events.EntityPull, events.ActionPulled, events.PullResult{RequestID: PullRequestID("pull-1", node), Image: "busybox"})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	await := func(node string) {
		t.Helper()
		select {
		case r := <-w.wait(PullRequestID("pull-1", node)):
			if r.Image != "busybox" {
				t.Fatalf("result %+v", r)
			}
		case <-time.After(bustest.Timeout):
			t.Fatalf("no result for %s from the follower in %v", node, bustest.Timeout)
		}
	}
	publish("node-a")
	await("node-a")
	w.mu.Lock()
	starts := w.starts
	w.progress = time.Now().Add(-time.Minute)
	seq := w.next
	w.mu.Unlock()
	w.nudge(seq)
	bustest.WaitFor(t, "the follower made anew", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.starts == starts+1
	})
	publish("node-b")
	await("node-b")
}
