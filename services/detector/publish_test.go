package detector_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/detector"
)

// storedImageEvents lists the node's events in the events stream as "type image-id", and their ids.
func storedImageEvents(t *testing.T, b *bus.Bus) (evs, ids []string) {
	t.Helper()
	err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		ev, err := events.DecodeEventMsg(m.Header, m.Data)
		if err != nil {
			t.Errorf("decode: %v", err)
			return bus.StopReading
		}
		var r events.ImageRecord
		if err := ev.DecodeData(&r); err != nil {
			t.Error(err)
		}
		evs, ids = append(evs, ev.Type+" "+r.ID), append(ids, ev.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return evs, ids
}

// TestUnpublishedEventsRetriedBeforeTheNextDetection: image events NATS refused are published again within
// seconds of it taking them, in order and once each, not at the next detection (Period, here an hour). Before,
// they waited for that detection, and a detect command during the refusal waited ~30 s for its events and
// then failed although its records were written.
func TestUnpublishedEventsRetriedBeforeTheNextDetection(t *testing.T) {
	b, rt, logs := startDetectorWithOneImage(t)

	// The events stream goes away (the records bucket stays): every publish of the node's events fails
	// (no responders) until it is back. Two detections meanwhile: their events queue, oldest first.
	if err := b.DeleteStream(t.Context(), events.EventsStream); err != nil {
		t.Fatal(err)
	}
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}, {ID: "sha256:b", Size: 1}}, nil, nil)
	start := time.Now()
	if rep := detect(t, b, time.Now()); rep.Records != 2 || rep.Added != 1 || rep.Unpublished != 1 {
		t.Fatalf("detect while the stream is gone = %+v, want 2 records, 1 added, 1 unpublished", rep)
	}
	set(rt, []cri.Image{{ID: "sha256:b", Size: 1}, {ID: "sha256:c", Size: 1}}, nil, nil)
	if rep := detect(t, b, time.Now()); rep.Records != 2 || rep.Unpublished != 3 {
		t.Fatalf("second detect while the stream is gone = %+v, want 2 records, 3 unpublished", rep)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("two detect commands took %v while NATS refused their events: they wait for the publish", took)
	}
	// The outage lasts until two retries (of 0.5-1 s, then 1-2 s) have failed too.
	bustest.WaitWithin(t, "two failed retries", 15*time.Second, func() bool {
		return strings.Count(logs.String(), "retry of image events failed") >= 2
	})

	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	want := []string{"imagefleet.image.detected.v1 sha256:b", "imagefleet.image.detected.v1 sha256:c", "imagefleet.image.vanished.v1 sha256:a"}
	// The next retry comes 2-4 s after the last failed one.
	bustest.Eventually(t, "the queued events in the stream", 10*time.Second, func() error {
		if evs, _ := storedImageEvents(t, b); !slices.Equal(evs, want) {
			return fmt.Errorf("stream holds %v", evs)
		}
		return nil
	})
	t.Logf("queued events stored %v after the stream came back", time.Since(back).Round(time.Millisecond))
	if !strings.Contains(logs.String(), "image events published on retry") {
		t.Errorf("no retry logged publishing the events:\n%s", logs.String())
	}

	// A detection afterwards publishes its own event only: nothing twice.
	set(rt, []cri.Image{{ID: "sha256:c", Size: 1}}, nil, nil)
	if rep := detect(t, b, time.Now()); rep.Unpublished != 0 {
		t.Fatalf("detect after the stream came back = %+v, want nothing unpublished", rep)
	}
	evs, ids := storedImageEvents(t, b)
	if want := append(want, "imagefleet.image.vanished.v1 sha256:b"); !slices.Equal(evs, want) {
		t.Fatalf("stream holds %v, want %v", evs, want)
	}
	slices.Sort(ids)
	if len(slices.Compact(ids)) != len(evs) {
		t.Fatalf("event ids %v: an event stored twice", ids)
	}
}

// TestDetectCommandsDoNotWaitForAnEventsOutage: while image events wait for Run's retry, detect commands
// answer as soon as their records are written: their events join the queue without a publish attempt of
// their own. Before, each made one, and a publish to an events stream without a leader takes half a second
// (nats.go's own no-responders retries) or, its ack lost with the old leader, bus.AttemptTimeout: after a
// server loss, the detect commands an operator's retries had queued up were answered one after the other,
// each half a second late, and a fresh one seconds after the records bucket had its leader back.
func TestDetectCommandsDoNotWaitForAnEventsOutage(t *testing.T) {
	b, rt, logs := startDetectorWithOneImage(t)

	if err := b.DeleteStream(t.Context(), events.EventsStream); err != nil {
		t.Fatal(err)
	}
	// Each detection finds a new image and the last one's gone: two events each (one the first time).
	const commands = 10
	var want []string
	start := time.Now()
	for i := range commands {
		id := fmt.Sprintf("sha256:n%02d", i)
		set(rt, []cri.Image{{ID: "sha256:a", Size: 1}, {ID: id, Size: 1}}, nil, nil)
		rep := detect(t, b, time.Now())
		want = append(want, "imagefleet.image.detected.v1 "+id)
		if i > 0 {
			want = append(want, fmt.Sprintf("imagefleet.image.vanished.v1 sha256:n%02d", i-1))
		}
		if rep.Added != 1 || rep.Removed != min(i, 1) || rep.Unpublished != len(want) {
			t.Fatalf("detect %d while the events stream is gone = %+v, want 1 added, %d removed, %d unpublished",
				i, rep, min(i, 1), len(want))
		}
	}
	took := time.Since(start)
	t.Logf("%d detect commands took %v while the events stream was gone", commands, took.Round(time.Millisecond))
	// The first detection tries (and fails); the others leave their events to the retry.
	if n := strings.Count(logs.String(), "image events not published; retrying"); n != 1 {
		t.Errorf("%d detections tried to publish their events while earlier ones waited for the retry, want 1 (the first)", n)
	}

	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	// Every event once, in detection order, from the retry (2-4 s after the last failed one at most here).
	bustest.Eventually(t, "the queued events in the stream", 15*time.Second, func() error {
		if evs, _ := storedImageEvents(t, b); !slices.Equal(evs, want) {
			return fmt.Errorf("stream holds %v", evs)
		}
		return nil
	})
}

// TestFailedDetectionRetriedBeforeTheNextPeriod: a detection that failed (the runtime did not list) is tried
// again within seconds, not a period later (here an hour): the node's records and image events follow as
// soon as the runtime answers. Before, they waited for the next period.
func TestFailedDetectionRetriedBeforeTheNextPeriod(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}}, nil, errors.New("rpc error: code = Unavailable desc = runtime not ready"))
	var logs bustest.SyncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	svc, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: logger}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	defer bustest.RunService(t, svc)()
	// The start detection and the first retry (0.5-1 s after it) fail.
	bustest.WaitWithin(t, "two failed detections", 10*time.Second, func() bool {
		return strings.Count(logs.String(), "failed to monitor images") >= 2
	})
	rt.FailList(nil)
	back := time.Now()
	// The next retry comes 1-2 s after the last failed one.
	bustest.Eventually(t, "the image's event in the stream", 10*time.Second, func() error {
		if evs, _ := storedImageEvents(t, b); !slices.Equal(evs, []string{"imagefleet.image.detected.v1 sha256:a"}) {
			return fmt.Errorf("stream holds %v", evs)
		}
		return nil
	})
	t.Logf("image detected %v after the runtime answered again", time.Since(back).Round(time.Millisecond))
	if got := load(t, b); len(got) != 1 {
		t.Fatalf("records %v, want sha256:a", got)
	}
}

// TestRecordsWriteInDoubtPublishesItsEvents: a records write that fails may have landed (its last attempt's
// ack lost to a timeout, as 10,000 agents starting at once saw: two nodes never published their 50
// image.detected events, the next detection finding every record stored). The next detection publishes the
// events of what the store shows written, once each, and a detection whose write did not land publishes them
// once when it is found again.
func TestRecordsWriteInDoubtPublishesItsEvents(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	svc, err := detector.New(detector.Config{Node: node, Period: time.Hour}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Open(t.Context()); err != nil {
		t.Fatal(err)
	}
	lost := errors.New("ack lost")
	mode := "ok"
	detector.SetStoreWrite(svc, func(ctx context.Context, puts []events.ImageRecord, deletes []string,
		write func(context.Context, []events.ImageRecord, []string) error) error {
		switch mode {
		case "landed": // written, reported failed
			if err := write(ctx, puts, deletes); err != nil {
				return err
			}
			return lost
		case "lost": // not written
			return lost
		}
		return write(ctx, puts, deletes)
	})
	step := func(m string, images []cri.Image, wantErr bool) {
		t.Helper()
		mode = m
		set(rt, images, nil, nil)
		_, err := svc.Detect(t.Context(), time.Now())
		if (err != nil) != wantErr {
			t.Fatalf("detect with the write %s: err %v, want an error %v", m, err, wantErr)
		}
	}
	a, bb, c := cri.Image{ID: "sha256:a", Size: 1}, cri.Image{ID: "sha256:b", Size: 1}, cri.Image{ID: "sha256:c", Size: 1}
	step("landed", []cri.Image{a, bb}, true)
	if evs, _ := storedImageEvents(t, b); len(evs) != 0 {
		t.Fatalf("events after a failed write: %v", evs)
	}
	step("ok", []cri.Image{a, bb}, false)
	step("landed", []cri.Image{bb}, true) // a vanished
	step("ok", []cri.Image{bb}, false)
	step("lost", []cri.Image{bb, c}, true) // c not written
	step("ok", []cri.Image{bb, c}, false)

	want := []string{"imagefleet.image.detected.v1 sha256:a", "imagefleet.image.detected.v1 sha256:b",
		"imagefleet.image.vanished.v1 sha256:a", "imagefleet.image.detected.v1 sha256:c"}
	evs, ids := storedImageEvents(t, b)
	if !slices.Equal(evs, want) {
		t.Fatalf("stream holds %v, want %v", evs, want)
	}
	slices.Sort(ids)
	if len(slices.Compact(ids)) != len(evs) {
		t.Fatalf("event ids %v: an event stored twice", ids)
	}
	if recs := load(t, b); len(recs) != 2 || recs["sha256:b"].ID == "" || recs["sha256:c"].ID == "" {
		t.Fatalf("records = %+v", recs)
	}
}

// startDetectorWithOneImage runs a detector (Period an hour: only commands detect) over a runtime holding
// sha256:a, logging at debug level, and waits for its start detection's event in the events stream.
func startDetectorWithOneImage(t *testing.T) (*bus.Bus, *critest.Runtime, *bustest.SyncBuffer) {
	t.Helper()
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}}, nil, nil)
	logs := &bustest.SyncBuffer{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	svc, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: logger}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bustest.RunService(t, svc))
	waitServing(t, b)
	bustest.WaitFor(t, "the start detection's event", func() bool {
		evs, _ := storedImageEvents(t, b)
		return slices.Equal(evs, []string{"imagefleet.image.detected.v1 sha256:a"})
	})
	return b, rt, logs
}
