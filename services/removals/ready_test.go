package removals

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestReadyOnceConsuming: Ready is closed only once the consumer of the node's events exists at the server,
// and an image vanished after it that nobody in imagefleet removed is reported.
func TestReadyOnceConsuming(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	s, err := New(Config{Node: node, Grace: time.Millisecond, Registerer: prometheus.NewRegistry()}, b)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Ready():
		t.Fatal("Ready closed before Run")
	default:
	}
	stop := bustest.RunService(t, s)
	defer stop()
	bustest.WaitClosed(t, "the removals worker ready", s.Ready())
	if _, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node)); err != nil {
		t.Fatalf("the removals consumer once ready: %v", err)
	}
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:dd", Size: 40})
	bustest.WaitFor(t, "the vanished image reported", func() bool { return len(warnings(t, b)) == 1 })
}
