package kevents

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestReadyOnceConsuming: Ready is closed only once the bridge's consumer exists at the server, and an event
// published after it is handled (here: skipped as not postable, with no API call).
func TestReadyOnceConsuming(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	kube, err := kubernetes.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1", Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(t.Context(), Config{Node: "node-1", Registerer: prometheus.NewRegistry()}, kube, b)
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
	bustest.WaitClosed(t, "the events bridge ready", s.Ready())
	if _, err := b.Consumer(t.Context(), events.EventsStream, Durable("node-1")); err != nil {
		t.Fatalf("the bridge's consumer once ready: %v", err)
	}
	if err := b.PublishRaw(events.EventSubject("node-1", events.EntityPull, events.ActionFailed), []byte("{not an event")); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the event published once ready handled", func() bool {
		return testutil.ToFloat64(s.m.results.WithLabelValues("malformed")) == 1
	})
}
