package kevents

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestRunSkipsWhatItCannotPost: over a real nats-server, events the bridge must not post (no severity, no
// object, a pre-pull, a body that is not an event, a pod event) are acked without a single API call (the
// client points at a closed port: any call would be retried and hold the consumer), and Run returns after
// cancel leaving no goroutine behind. Posting itself is tested against a real kube-apiserver
// (integration/kevents_test.go).
func TestRunSkipsWhatItCannotPost(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	kube, err := kubernetes.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1", Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	s, err := New(t.Context(), Config{Node: "node-1", Registerer: reg}, kube, b)
	if err != nil {
		t.Fatal(err)
	}
	var evs []events.Event
	add := func(entity, action, sev, reason string, obj *events.ObjectRef) {
		ev, err := events.New("node-1", entity, action, nil)
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev.WithKube(sev, reason, "m", obj))
	}
	pod := &events.ObjectRef{Kind: "Pod", Namespace: "ns", Name: "p", UID: "u"}
	add(events.EntityPull, events.ActionPulled, events.Normal, "Pulled", nil)                                        // a pre-pull
	add(events.EntityImage, events.ActionRemoved, "", "", nil)                                                       // no Kubernetes event
	add("secret", "registered", "", "Registered", pod)                                                               // not postable
	add(events.EntityPull, events.ActionFailed, events.Warning, "Failed", &events.ObjectRef{Kind: "Pod", Name: "p"}) // no namespace
	if err := b.PublishAll(t.Context(), evs); err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{events.EventSubject("node-1", events.EntityPull, events.ActionFailed), events.EventSubject("node-1", "pod", "added")} {
		if err := b.PublishRaw(subj, []byte("{not an event")); err != nil {
			t.Fatal(err)
		}
	}
	stop := bustest.RunService(t, s)
	// Drained, and every message handled: a consumer's state alone read "drained" once (CI under -race,
	// nothing handled yet) before any message was handled.
	bustest.Eventually(t, "the consumer drained and both skips counted", 10*time.Second, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, Durable("node-1"))
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0) {
			err = fmt.Errorf("%+v", st)
		}
		if err == nil && testutil.ToFloat64(s.m.results.WithLabelValues("ignored"))+testutil.ToFloat64(s.m.results.WithLabelValues("malformed")) < 3 {
			err = fmt.Errorf("ignored %v, malformed %v so far", testutil.ToFloat64(s.m.results.WithLabelValues("ignored")),
				testutil.ToFloat64(s.m.results.WithLabelValues("malformed")))
		}
		return err
	})
	stop()
	for result, want := range map[string]float64{"ignored": 2, "malformed": 1, "created": 0} {
		if got := testutil.ToFloat64(s.m.results.WithLabelValues(result)); got != want {
			t.Errorf("result %s = %v, want %v", result, got, want)
		}
	}
	if got := testutil.ToFloat64(s.m.apiErrors); got != 0 {
		t.Errorf("%v API errors: the bridge called the API server for events it must not post", got)
	}
}
