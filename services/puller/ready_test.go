package puller

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestReadyOnceServing: Ready is closed only once the puller can serve: its consumer exists at the server,
// a cancellation sent at once (core NATS, lost without a subscription) is heard, and a request queued at
// once is answered.
func TestReadyOnceServing(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	s, _ := startService(t, b, rt, Config{})
	select {
	case <-s.Ready():
	case <-time.After(bustest.Timeout):
		t.Fatalf("not ready after %v", bustest.Timeout)
	}
	if _, err := b.Consumer(t.Context(), events.PullStreamOf(testNode), events.PullerDurable(testNode)); err != nil {
		t.Fatalf("the pull consumer once ready: %v", err)
	}
	cancelJSON, _ := json.Marshal(events.PullCancel{RequestID: "r0"})
	if err := b.PublishRaw(events.CommandSubject(testNode, events.VerbPullCancel), cancelJSON); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the cancellation sent once ready heard", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		_, ok := s.withdrawn["r0"]
		return ok
	})
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "r1", Image: "missing_image", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	if ev, r, _ := nextResult(t, sub, "r1", 10*time.Second); ev.Type != events.TypeName(events.EntityPull, events.ActionPulled) || r.ImageRef == "" {
		t.Fatalf("request queued once ready: %s %+v", ev.Type, r)
	}
}
