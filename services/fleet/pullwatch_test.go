package fleet

import (
	"testing"

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
