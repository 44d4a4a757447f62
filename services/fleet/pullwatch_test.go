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
