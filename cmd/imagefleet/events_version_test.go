package main_test

import (
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestEventsReadsBothVersions: `imagefleet events` prints v1 and v2 events of the stream alike (the v2
// envelope read from its CloudEvents headers), and --type entity.action matches both versions.
func TestEventsReadsBothVersions(t *testing.T) {
	srv, b1 := bustest.Start(t)
	b2 := bustest.Connect(t, srv)
	if err := b2.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	const node = "node-ver"
	mk := func(id string) events.Event {
		ev, err := events.New(node, events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: id, Size: 10, Reason: "space"})
		if err != nil {
			t.Fatal(err)
		}
		return ev.WithKube(events.Normal, "ImageGCed", "removed "+id, &events.ObjectRef{Kind: "Node", Name: node})
	}
	ev1, ev2 := mk("sha256:11"), mk("sha256:22")
	if err := b1.Publish(t.Context(), ev1); err != nil {
		t.Fatal(err)
	}
	if err := b2.Publish(t.Context(), ev2); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := run(t, "events", "--nats", srv.ClientURL(), "--node", node, "--type", "image.removed", "-o", "json")
	if code != 0 {
		t.Fatalf("events: exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("events printed %d lines, want 2:\n%s", len(lines), out)
	}
	wantTypes := []string{"imagefleet.image.removed.v1", "imagefleet.image.removed.v2"}
	for i, want := range []events.Event{ev1, ev2} {
		got, err := events.DecodeEvent([]byte(lines[i]))
		if err != nil {
			t.Fatalf("line %q: %v", lines[i], err)
		}
		var r events.ImageRemoved
		if err := got.DecodeData(&r); err != nil || got.ID != want.ID || got.Type != wantTypes[i] || got.Reason != "ImageGCed" || got.Message != want.Message ||
			got.Object == nil || got.Object.Name != node || "removed "+r.ID != want.Message {
			t.Errorf("line %d: %+v (data %+v, %v), want %+v", i, got, r, err, want)
		}
	}
}
