package removals

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

const node = "node-1"

func publish(t *testing.T, b *bus.Bus, action string, data any) {
	t.Helper()
	ev, err := events.New(node, events.EntityImage, action, data)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(t.Context(), ev); err != nil {
		t.Fatal(err)
	}
}

func warnings(t *testing.T, b *bus.Bus) []events.Event {
	t.Helper()
	var out []events.Event
	err := b.Read(t.Context(), events.EventsStream, events.EventSubject(node, events.EntityNode, events.ActionWarning), func(m bus.StreamMsg) error {
		ev, err := events.DecodeEvent(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestForeignRemovals: over a real nats-server, an image that vanished after an imagefleet removal is not
// reported, nor one whose removal is published just after it vanished (within the grace); one nobody in
// imagefleet removed is counted and reported once as a Warning on the node, also across a restart; bad input
// is skipped.
func TestForeignRemovals(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	reg := prometheus.NewRegistry()
	// The worker's clock stands still from before the events until cc's removal is published, so the graces
	// of bb and cc (from their events' times, at most a grace from now) cannot end before it however slow
	// the machine: a removal published late would make cc reported. Then it moves a grace past any event.
	const grace = 2 * time.Second
	var held atomic.Bool
	held.Store(true)
	start := time.Now()
	now := func() time.Time {
		if held.Load() {
			return start
		}
		return time.Now().Add(grace)
	}
	publish(t, b, events.ActionRemoved, events.ImageRemoved{ID: "sha256:aa", Size: 10, Reason: "space"})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:aa", Size: 10})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:bb", RepoTags: []string{"r/b:1"}, Size: 20})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:cc", Size: 30}) // GC's removal follows
	if err := b.PublishRaw(events.EventSubject(node, events.EntityImage, events.ActionVanished), []byte("not json")); err != nil {
		t.Fatal(err)
	}
	run := func() (stop func()) {
		s, err := New(Config{Node: node, Grace: grace, Registerer: reg, Now: now}, b)
		if err != nil {
			t.Fatal(err)
		}
		return bustest.RunService(t, s)
	}
	stop := run()
	// cc's removal comes once the worker follows the stream (a message in flight: bb waits out its grace),
	// not among the removals it reads at its start.
	bustest.Eventually(t, "the worker following the stream", bustest.Timeout, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && st.NumAckPending == 0 {
			err = fmt.Errorf("nothing in flight: %+v", st)
		}
		return err
	})
	publish(t, b, events.ActionRemoved, events.ImageRemoved{ID: "sha256:cc", Size: 30, Reason: "space"})
	held.Store(false)
	bustest.Eventually(t, "the removals consumer drained and a warning published", 15*time.Second, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0 || len(warnings(t, b)) == 0) {
			err = fmt.Errorf("not drained: %+v", st)
		}
		return err
	})
	stop()
	// A restart that reads everything again reports nothing new (the warning's id derives from the event's).
	if err := b.Request(t.Context(), "$JS.API.CONSUMER.DELETE."+events.EventsStream+"."+events.RemovalsDurable(node), nil, nil); err != nil {
		t.Logf("delete consumer: %v", err)
	}
	stop = run()
	// Drained means the worker's pull request waits with nothing pending or unacked. The counts alone are not
	// enough: the server can report a consumer it has just made with nothing pending before it has counted
	// the stream, and the test then stopped the worker before it had read anything.
	bustest.Eventually(t, "the restarted removals consumer read the stream again", 15*time.Second, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0 || st.NumWaiting == 0) {
			err = fmt.Errorf("not drained: %+v", st)
		}
		return err
	})
	stop()

	ws := warnings(t, b)
	if len(ws) != 1 {
		t.Fatalf("warnings %+v, want one (sha256:bb)", ws)
	}
	w := ws[0]
	if w.Reason != ReasonImageRemovedExternally || w.Severity != events.Warning || w.Object == nil || w.Object.Kind != "Node" ||
		w.Object.Name != node || !strings.Contains(w.Message, "sha256:bb (r/b:1, 20 bytes) was removed from the node by something other than imagefleet") {
		t.Fatalf("warning %+v", w)
	}
	var nw events.NodeWarning
	if err := w.DecodeData(&nw); err != nil || nw.Reason != w.Reason || nw.Message != w.Message {
		t.Fatalf("warning data %+v, %v", nw, err)
	}
	// Counted once per run that saw it: the first run, and the second (which read the stream again).
	if n := testutil.ToFloat64(prometheus.Collector(must(reg))); n != 2 {
		t.Fatalf("imagefleet_images_removed_externally_total = %v, want 2 (once per reading)", n)
	}
}

func must(reg *prometheus.Registry) prometheus.Counter {
	s, _ := New(Config{Node: node, Registerer: reg}, nil)
	return s.counter
}

// TestNewRefusesAMetricOfAnotherKind: a registry that already holds the counter, same name and help, as a
// collector that cannot be counted (a CounterFunc, as an exporter of another process's figure would register)
// gets a clear error from New, not a panic.
func TestNewRefusesAMetricOfAnotherKind(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "imagefleet", Name: "images_removed_externally_total",
		Help: "Images that vanished from the node without an imagefleet removal (another remover at work: the kubelet's image GC or eviction manager, crictl rmi, ...)."},
		func() float64 { return 0 }))
	s, err := New(Config{Node: node, Registerer: reg}, nil)
	if err == nil || s != nil {
		t.Fatalf("New = %v, %v; want an error", s, err)
	}
	if !strings.Contains(err.Error(), "register metrics") {
		t.Errorf("error %q does not say what failed", err)
	}
}

// TestVanishedInTheFutureWaitsOnlyTheGrace: a vanished event whose time lies far ahead (a skewed or
// malformed clock) waits the grace from when it is handled, not from its time: it is reported within the
// grace and the node's events behind it are not held.
func TestVanishedInTheFutureWaitsOnlyTheGrace(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ev, err := events.New(node, events.EntityImage, events.ActionVanished, events.ImageRecord{ID: "sha256:ff", Size: 5})
	if err != nil {
		t.Fatal(err)
	}
	ev.Time = time.Now().Add(time.Hour)
	if err := b.Publish(t.Context(), ev); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Node: node, Grace: 200 * time.Millisecond, Registerer: prometheus.NewRegistry()}, b)
	if err != nil {
		t.Fatal(err)
	}
	stop := bustest.RunService(t, s)
	bustest.Eventually(t, "the future vanished event reported", 15*time.Second, func() error {
		if n := len(warnings(t, b)); n != 1 {
			return fmt.Errorf("%d warnings, want 1", n)
		}
		return nil
	})
	stop()
	if n := testutil.ToFloat64(s.counter); n != 1 {
		t.Fatalf("imagefleet_images_removed_externally_total = %v, want 1", n)
	}
}
