package detector_test

import (
	"context"
	"errors"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/detector"
)

// set makes rt list images and containers, or fail both lists with err.
func set(rt *critest.Runtime, images []cri.Image, containers []cri.Container, err error) {
	rt.SetImages(images...)
	rt.SetContainers(containers...)
	rt.FailList(err)
}

const node = "node-1.example"

// start runs a detector until the returned stop is called; stop asserts Run returned nil.
func start(t *testing.T, b *bus.Bus, rt *critest.Runtime, now func() time.Time) (stop func()) {
	t.Helper()
	svc, err := detector.New(detector.Config{Node: node, Period: time.Hour, Now: now}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	stop = bustest.RunService(t, svc)
	waitServing(t, b)
	return stop
}

func waitServing(t *testing.T, b *bus.Bus) {
	t.Helper()
	bustest.Eventually(t, "the detector serving", 10*time.Second, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		return b.Request(ctx, events.QuerySubject(node, events.QryRecords), events.QueryRequest{}, nil)
	})
}

func detect(t *testing.T, b *bus.Bus, at time.Time) events.DetectReply {
	t.Helper()
	var rep events.DetectReply
	if err := b.Request(t.Context(), events.CommandSubject(node, events.VerbDetect), events.DetectRequest{Time: &at}, &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

func load(t *testing.T, b *bus.Bus) map[string]events.ImageRecord {
	t.Helper()
	st, err := records.OpenStore(t.Context(), b, node)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRecordsSurviveRestart: the kubelet loses firstDetected and lastUsed on restart
// (kubernetes/kubernetes#119642); the detector keeps them in KV.
func TestRecordsSurviveRestart(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:a", Size: 10}, {ID: "sha256:b", Size: 20}}, []cri.Container{{ID: "c1", ImageID: "sha256:b"}}, nil)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := t0
	stop := start(t, b, rt, func() time.Time { return clock })
	rep := detect(t, b, t0)
	if rep.Records != 2 || rep.InUse != 1 {
		t.Fatalf("reply = %+v", rep)
	}
	stop()

	// A restart an hour later: new detection must not reset firstDetected, and lastUsed of the unused image
	// stays zero while the used one advances.
	clock = t0.Add(time.Hour)
	stop = start(t, b, rt, func() time.Time { return clock })
	defer stop()
	detect(t, b, clock)
	recs := load(t, b)
	if got := recs["sha256:a"]; !got.FirstDetected.Equal(t0) || !got.LastUsed.IsZero() {
		t.Errorf("sha256:a after restart = %+v, want firstDetected %v", got, t0)
	}
	if got := recs["sha256:b"]; !got.FirstDetected.Equal(t0) || !got.LastUsed.Equal(clock) || !got.InUse {
		t.Errorf("sha256:b after restart = %+v, want lastUsed %v", got, clock)
	}
}

func TestDetectPublishesDetectedAndVanished(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:a", Size: 10}}, nil, nil)
	stop := start(t, b, rt, time.Now)
	defer stop()
	detect(t, b, time.Now())
	set(rt, []cri.Image{{ID: "sha256:b", Size: 10}}, nil, nil)
	detect(t, b, time.Now())
	var types []string
	err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		ev, err := events.DecodeEvent(m.Data)
		if err != nil {
			t.Errorf("decode: %v", err)
			return bus.StopReading
		}
		var r events.ImageRecord
		if err := ev.DecodeData(&r); err != nil {
			t.Error(err)
		}
		types = append(types, ev.Type+" "+r.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"imagefleet.image.detected.v1 sha256:a", "imagefleet.image.detected.v1 sha256:b", "imagefleet.image.vanished.v1 sha256:a"}
	if strings.Join(types, ",") != strings.Join(want, ",") {
		t.Fatalf("events = %v, want %v", types, want)
	}
	if recs := load(t, b); len(recs) != 1 || recs["sha256:b"].ID == "" {
		t.Fatalf("records = %+v", recs)
	}
}

func TestBadRequestsAndRuntimeErrorsKeepTheWorkerRunning(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	stop := start(t, b, rt, time.Now)
	defer stop()
	for body, want := range map[string]string{
		`{"time":`:             "malformed message",
		`{"bogus":1}`:          `unknown field "bogus"`,
		`{"time":"yesterday"}`: "malformed message",
	} {
		rep, err := b.RequestRaw(t.Context(), events.CommandSubject(node, events.VerbDetect), []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(rep.Error, want) {
			t.Errorf("body %s: error %q, want %q", body, rep.Error, want)
		}
	}
	set(rt, nil, nil, errors.New("connection refused"))
	err := b.Request(t.Context(), events.CommandSubject(node, events.VerbDetect), nil, nil)
	if !errors.Is(err, bus.ErrRemote) || !strings.Contains(err.Error(), "detect images: connection refused") {
		t.Fatalf("runtime error reply = %v", err)
	}
	set(rt, []cri.Image{{ID: "x", Size: 1}}, nil, nil)
	if rep := detect(t, b, time.Now()); rep.Records != 1 {
		t.Fatalf("after errors: %+v", rep)
	}
}

func TestNewValidates(t *testing.T) {
	_, b := bustest.Start(t)
	for _, tc := range []struct {
		cfg  detector.Config
		want string
	}{
		{detector.Config{}, "node name is empty"},
		{detector.Config{Node: "Bad_Name"}, "not a DNS-1123 subdomain"},
		{detector.Config{Node: "n", Period: -time.Second}, "must not be negative"},
	} {
		if _, err := detector.New(tc.cfg, critest.NewRuntime(), b); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want %q", tc.cfg, err, tc.want)
		}
	}
}
