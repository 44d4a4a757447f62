package detector_test

import (
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"slices"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// recordIDs asks the detector for the node's records.
func recordIDs(t *testing.T, b *bus.Bus) []string {
	t.Helper()
	var rep events.RecordsReply
	if err := b.Request(t.Context(), events.QuerySubject(node, events.QryRecords), events.QueryRequest{}, &rep); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range rep.Records {
		ids = append(ids, r.ID)
	}
	slices.Sort(ids)
	return ids
}

func TestRecordsFollowPullsAndRemovals(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}}, nil, nil)
	defer start(t, b, rt, nil)() // Period 1h: only the start detection and the events
	// The records query is served as Run starts, before the start detection has written (under -race this
	// read [] 1 run in 8): wait for that detection.
	bustest.Eventually(t, "the start detection's record", 10*time.Second, func() error {
		if got := recordIDs(t, b); !slices.Equal(got, []string{"sha256:a"}) {
			return fmt.Errorf("records %v", got)
		}
		return nil
	})

	// A pull: a detection at once.
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}, {ID: "sha256:b", Size: 2}}, nil, nil)
	pulled, err := events.New(node, events.EntityPull, events.ActionPulled, events.PullResult{})
	if err != nil {
		t.Fatal(err)
	}
	// The detector subscribes as Run starts: publish again until it has (then the removal below is timed).
	bustest.Eventually(t, "the pulled image's record", 10*time.Second, func() error {
		if got := recordIDs(t, b); !slices.Equal(got, []string{"sha256:a", "sha256:b"}) {
			if err := b.Publish(t.Context(), pulled); err != nil {
				t.Fatal(err)
			}
			return fmt.Errorf("records %v", got)
		}
		return nil
	})

	// A removal by GC: the record goes with it, although the runtime (here) still lists the image, and no
	// image.vanished event is published for it.
	removed, err := events.New(node, events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: "sha256:a", Size: 1, Reason: "space"})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(t.Context(), removed); err != nil {
		t.Fatal(err)
	}
	// Only the event can do it within the wait (the next detection is an hour away): a tighter bound would
	// catch no other defect, only a loaded machine.
	bustest.WaitFor(t, "the removed image's record deleted", func() bool { return slices.Equal(recordIDs(t, b), []string{"sha256:b"}) })
	var vanished int
	err = b.Read(t.Context(), events.EventsStream, events.EventSubject(node, events.EntityImage, events.ActionVanished), func(bus.StreamMsg) error { vanished++; return nil })
	if err != nil {
		t.Fatal(err)
	}
	if vanished != 0 {
		t.Errorf("%d image.vanished events, want none", vanished)
	}
}
