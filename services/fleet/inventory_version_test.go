package fleet_test

import (
	"testing"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestInventoryAppliesBothVersions: a mixed fleet's v1 and v2 image events are applied alike (the v2
// envelope from its headers, the record from the body), and a v2 event without its record is refused.
func TestInventoryAppliesBothVersions(t *testing.T) {
	_, b := bustest.Start(t)
	inv, err := fleet.NewInventory(t.Context(), fleet.InventoryConfig{Replica: "r"}, b)
	if err != nil {
		t.Fatal(err)
	}
	msg := func(seq uint64, ev events.Event, version string) *bus.Msg {
		ev, err := ev.AsVersion(version)
		if err != nil {
			t.Fatal(err)
		}
		m, err := bus.EventMsg(ev)
		if err != nil {
			t.Fatal(err)
		}
		return &bus.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data, StreamSeq: seq}
	}
	steps := []struct {
		name          string
		m             *bus.Msg
		wantApplied   int64
		wantPermanent bool
	}{
		{"v1 detected", msg(10, detected(t, "n1", "sha256:d1", "x:1", 10), events.V1), 1, false},
		{"v2 detected", msg(11, detected(t, "n2", "sha256:d1", "x:1", 10), events.V2), 2, false},
		{"v2 removed", msg(12, imageEvent(t, "n1", events.ActionRemoved, events.ImageRemoved{ID: "sha256:d1"}), events.V2), 3, false},
		{"v2 detected without id", msg(13, imageEvent(t, "n1", events.ActionDetected, events.ImageRecord{}), events.V2), 3, true},
		{"v2 with a broken body", func() *bus.Msg {
			m := msg(14, detected(t, "n1", "sha256:d2", "x:1", 10), events.V2)
			m.Data = []byte("{")
			return m
		}(), 3, true},
	}
	for _, st := range steps {
		err := inv.Apply(t.Context(), st.m)
		if bus.IsPermanent(err) != st.wantPermanent || (!st.wantPermanent && err != nil) {
			t.Fatalf("%s: err = %v", st.name, err)
		}
		if s := inv.Stats(); s.Applied != st.wantApplied || s.Duplicates != 0 {
			t.Fatalf("%s: stats %+v, want %d applied", st.name, s, st.wantApplied)
		}
	}
}
