package detector_test

import (
	"errors"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/detector"
)

// TestReadyOnceDetected: while the runtime fails Ready stays open; once a detection succeeded it closes,
// and at once the records query (another connection) lists the runtime's image and a detect command is
// answered.
func TestReadyOnceDetected(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:aa", RepoTags: []string{"r/a:1"}, Size: 10}}, nil, errors.New("runtime down"))
	svc, err := detector.New(detector.Config{Node: node, Period: time.Hour}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	stop := bustest.RunService(t, svc)
	defer stop()
	// The detector answers (the records query) but has not detected: not ready.
	bustest.Eventually(t, "the detector serving", bustest.Timeout, func() error {
		return client.Request(t.Context(), events.QuerySubject(node, events.QryRecords), events.QueryRequest{}, nil)
	})
	select {
	case <-svc.Ready():
		t.Fatal("ready while every detection failed")
	default:
	}
	rt.FailList(nil)
	bustest.WaitClosed(t, "the detector ready after the runtime came back", svc.Ready())
	var recs events.RecordsReply
	if err := client.Request(t.Context(), events.QuerySubject(node, events.QryRecords), events.QueryRequest{}, &recs); err != nil {
		t.Fatal(err)
	}
	if len(recs.Records) != 1 || recs.Records[0].ID != "sha256:aa" {
		t.Errorf("records once ready: %+v, want the runtime's one image", recs.Records)
	}
	var rep events.DetectReply
	if err := client.Request(t.Context(), events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &rep); errors.Is(err, bus.ErrNoResponders) || err != nil {
		t.Fatalf("detect command once ready: %v", err)
	}
	if rep.Records != 1 {
		t.Errorf("detect reply %+v, want 1 record", rep)
	}
}
