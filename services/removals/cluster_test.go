package removals

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestClusterUpgradeAndServerLoss: on a three-server cluster with R3 streams, the previous layout's R3
// durable is updated in place to one replica and the vanished filter, keeping its ack floor; when the one
// server holding it is stopped, the worker waits OfflineWait, deletes it and makes it anew on a running server
// after the last vanished event it handled: one published while the server is down is reported, none twice.
func TestClusterUpgradeAndServerLoss(t *testing.T) {
	c := bustest.StartCluster(t, 3, bustest.ClusterName("rm"))
	b := c.Connect("operator")
	bustest.Eventually(t, "the streams", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		return b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: c.N()})
	})
	// The previous worker's durable (R3 as its stream), which handled a1.
	if err := b.EnsureConsumer(t.Context(), previousConsumer(false)); err != nil {
		t.Fatal(err)
	}
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a1", Size: 1})
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:a2", Size: 1})
	ackFirst(t, b, 1, false)

	w := c.Connect("agent")
	s, stop := startWorker(t, w, Config{OfflineWait: 2 * time.Second})
	defer stop()
	wantWarned(t, b, "sha256:a2")
	drained(t, b)
	// The scale down to one replica completes in the background: the other servers leave its group, then the
	// cluster's record names the one server left. A server stopped before that may leave the consumer
	// unanswered rather than offline.
	var st bus.ConsumerState
	bustest.Eventually(t, "the consumer on one server", time.Minute, func() (err error) {
		st, err = b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && (st.Followers != 0 || st.Reconfiguring) {
			err = fmt.Errorf("still replicated: %+v", st)
		}
		return err
	})
	if st.Replicas != 1 || !slices.Equal(st.Filters, []string{events.EventSubject(node, events.EntityImage, events.ActionVanished)}) || st.Leader == "" {
		t.Fatalf("consumer after the upgrade %+v, want one replica, the vanished filter, a server holding it", st)
	}
	held := c.Index(st.Leader)
	if held < 0 {
		t.Fatalf("consumer held by %q, not a server of the cluster", st.Leader)
	}
	c.Stop(held)
	// The events stream may have lost its leader with the server: its new one is elected within seconds.
	ev, err := events.New(node, events.EntityImage, events.ActionVanished, events.ImageRecord{ID: "sha256:b1", Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "b1's vanished event stored", time.Minute, func() error { return b.Publish(t.Context(), ev) })
	// Its loss is noticed within seconds (pulls unanswered, then the consumer's info), then OfflineWait.
	wantWarnedWithin(t, b, 2*time.Minute, "sha256:a2", "sha256:b1")
	st = drained(t, b)
	t.Logf("consumer after the loss: %+v", st)
	if st.Leader == "" || st.Leader == c.Name(held) || st.Replicas != 1 {
		t.Fatalf("consumer made anew %+v, want one replica on a running server", st)
	}
	// The stopped server comes back; the worker goes on with the consumer made anew.
	c.Start(held)
	publish(t, b, events.ActionVanished, events.ImageRecord{ID: "sha256:b2", Size: 1})
	wantWarned(t, b, "sha256:a2", "sha256:b1", "sha256:b2")
	drained(t, b)
	stop()
	if got := warnedIDs(t, b); !slices.Equal(got, []string{"sha256:a2", "sha256:b1", "sha256:b2"}) {
		t.Fatalf("warned of %v", got)
	}
	// The stream keeps one warning per event id for its duplicate window: the count says none was reported
	// twice.
	if n := testutil.ToFloat64(s.counter); n != 3 {
		t.Fatalf("imagefleet_images_removed_externally_total = %v, want 3", n)
	}
}
