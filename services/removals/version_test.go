package removals

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestForeignRemovalsMixedVersions: during a rolling upgrade one agent writes v1 and another v2; the removals
// worker reads both: a v1 removal matches a v2 vanished event (not reported), a v2 vanished event with no
// removal is reported once.
func TestForeignRemovalsMixedVersions(t *testing.T) {
	srv, b := bustest.Start(t) // writes v1
	b2 := bustest.Connect(t, srv)
	if err := b2.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	publish(t, b, events.ActionRemoved, events.ImageRemoved{ID: "sha256:aa", Size: 10, Reason: "space"})
	publish(t, b2, events.ActionVanished, events.ImageRecord{ID: "sha256:aa", Size: 10})
	publish(t, b2, events.ActionVanished, events.ImageRecord{ID: "sha256:bb", RepoTags: []string{"r/b:1"}, Size: 20})
	var types []string
	if err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		types = append(types, m.Header.Get(events.HeaderType))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(types) != "[imagefleet.image.removed.v1 imagefleet.image.vanished.v2 imagefleet.image.vanished.v2]" {
		t.Fatalf("stored types %v, want one v1 removal and two v2 vanished events", types)
	}
	s, err := New(Config{Node: node, Grace: time.Second}, b)
	if err != nil {
		t.Fatal(err)
	}
	stop := bustest.RunService(t, s)
	bustest.Eventually(t, "the removals consumer drained and a warning published", 15*time.Second, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, events.RemovalsDurable(node))
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0 || len(warnings(t, b)) == 0) {
			err = fmt.Errorf("not drained: %+v", st)
		}
		return err
	})
	stop()
	ws := warnings(t, b)
	if len(ws) != 1 || ws[0].Reason != ReasonImageRemovedExternally {
		t.Fatalf("warnings %+v, want one ImageRemovedExternally (sha256:bb)", ws)
	}
	var nw events.NodeWarning
	if err := ws[0].DecodeData(&nw); err != nil || !containsAll(ws[0].Message, "sha256:bb", "r/b:1", "20 bytes") {
		t.Fatalf("warning %+v (%v): want it about sha256:bb", ws[0], err)
	}
}

func containsAll(s string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
