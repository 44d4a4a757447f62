package bus_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// v2Event is a node warning about a pod with a payload: every v2 header is set.
func v2Event(t *testing.T, node string) events.Event {
	t.Helper()
	ev, err := events.New(node, events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: "sha256:1", Size: 10, Reason: "space"})
	if err != nil {
		t.Fatal(err)
	}
	return ev.WithKube(events.Warning, "ImageRemoved", "removed sha256:1", &events.ObjectRef{Kind: "Pod", Namespace: "ns", Name: "p", UID: "u-1", FieldPath: "spec.containers{c}"})
}

// checkV2 checks a stored message is the v2 wire form of ev (the event as published, type v1).
func checkV2(t *testing.T, m bus.StreamMsg, ev events.Event) {
	t.Helper()
	want, _ := ev.AsVersion(events.V2)
	wantH, wantBody, err := events.EncodeEvent(want)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m.Data, wantBody) || !bytes.Equal(m.Data, ev.Data) {
		t.Errorf("body %q, want the payload alone %q", m.Data, ev.Data)
	}
	for k, v := range wantH {
		if got := m.Header.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
	if m.Header.Get(events.HeaderContentType) != "" {
		t.Errorf("v2 message carries %s %q; the binding names it %s", events.HeaderContentType, m.Header.Get(events.HeaderContentType), events.HeaderDataContentType)
	}
	got, err := events.DecodeEventMsg(m.Header, m.Data)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Time.Equal(want.Time) {
		t.Errorf("time %v, want %v", got.Time, want.Time)
	}
	got.Time = want.Time
	if got.Type != want.Type || got.ID != want.ID || got.Node != want.Node || got.Reason != want.Reason || got.Message != want.Message ||
		got.Severity != want.Severity || *got.Object != *want.Object || !bytes.Equal(got.Data, want.Data) {
		t.Errorf("decoded %+v, want %+v", got, want)
	}
}

func readNode(t *testing.T, b *bus.Bus, node string) []bus.StreamMsg {
	t.Helper()
	var got []bus.StreamMsg
	if err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error { got = append(got, m); return nil }); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestEventVersionWritesV2AndV1StaysDefault(t *testing.T) {
	_, b := bustest.Start(t)
	const node = "ver-node"
	v1 := v2Event(t, node)
	if err := b.Publish(t.Context(), v1); err != nil {
		t.Fatal(err)
	}
	if err := b.SetEventVersion("v3"); err == nil {
		t.Fatal("SetEventVersion accepted v3")
	}
	if err := b.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	ev := v2Event(t, node)
	evs := []events.Event{ev}
	if err := b.PublishAll(t.Context(), evs); err != nil {
		t.Fatal(err)
	}
	if evs[0].Type != events.TypeName(events.EntityImage, events.ActionRemoved) {
		t.Errorf("PublishAll changed the caller's event to %s", evs[0].Type)
	}
	got := readNode(t, b, node)
	if len(got) != 2 {
		t.Fatalf("stored %d events, want 2", len(got))
	}
	if got[0].Header.Get(events.HeaderType) != "imagefleet.image.removed.v1" || got[0].Header.Get(events.HeaderContentType) != "application/json" {
		t.Errorf("default writer: headers %v, want v1", got[0].Header)
	}
	if dec, err := events.DecodeEvent(got[0].Data); err != nil || dec.ID != v1.ID {
		t.Errorf("default writer: body is not the v1 envelope: %v", err)
	}
	checkV2(t, got[1], ev)
}

// TestJournalKeepsV2: events journaled while NATS is away, and sent by the next process, are stored in
// the version they were published in, with every header.
func TestJournalKeepsV2(t *testing.T) {
	r := startRestartable(t)
	dir := t.TempDir()
	const node = "journal-v2"
	b1 := connectJournaled(t, r, bus.JournalConfig{Dir: dir})
	if err := b1.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	r.stop()
	ev := v2Event(t, node)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	err := b1.Publish(ctx, ev)
	cancel()
	if err != nil {
		t.Fatalf("publish while nats is down: %v", err)
	}
	b1.Close()

	r.start()
	b2 := connectJournaled(t, r, bus.JournalConfig{Dir: dir}) // writer version v1: the journal keeps the event's
	var got []bus.StreamMsg
	bustest.WaitWithin(t, "the journaled event stored", 10*time.Second, func() bool { got = readNode(t, b2, node); return len(got) == 1 })
	checkV2(t, got[0], ev)
}

// TestReplayV2DeadLetter: a dead-lettered v2 event replays as the same message, every header kept.
func TestReplayV2DeadLetter(t *testing.T) {
	_, b := bustest.Start(t)
	const node = "dl-v2"
	if err := b.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	ev := v2Event(t, node)
	if err := b.Publish(t.Context(), ev); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(cctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: "dl-v2", FilterSubjects: []string{events.NodeEvents(node)}},
			func(context.Context, *bus.Msg) error { return bus.Permanent(errors.New("poison")) })
	}()
	var dls []bus.DeadLetter
	bustest.WaitWithin(t, "a dead letter", 10*time.Second, func() bool {
		var err error
		dls, err = b.DeadLetters(t.Context(), "")
		return err == nil && len(dls) == 1
	})
	cancel()
	<-done
	if _, err := b.ReplayDeadLetter(t.Context(), dls[0].Seq, false); err != nil {
		t.Fatal(err)
	}
	got := readNode(t, b, node)
	if len(got) != 2 {
		t.Fatalf("stored %d messages, want the original and its replay", len(got))
	}
	checkV2(t, got[1], ev)
}
