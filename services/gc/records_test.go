package gc

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/detector"
)

// TestBusRecordsAsksTheDetector: the production record source sends the detect command with the pass's
// freeTime (new records get it as firstDetected) and reads what the detector wrote to KV.
func TestBusRecordsAsksTheDetector(t *testing.T) {
	_, b := bustest.Start(t)
	rs := &busRecords{bus: b, node: testNode, timeout: 5 * time.Second}
	if _, err := rs.Detect(t.Context(), time.Now()); !errors.Is(err, bus.ErrNoResponders) {
		t.Fatalf("no detector running: err = %v, want ErrNoResponders", err)
	}

	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 200))
	rt.SetContainers(makeContainer(1))
	d, err := detector.New(detector.Config{Node: testNode, Period: time.Hour, Logger: slog.New(slog.DiscardHandler)}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	defer bustest.RunService(t, d)()

	// The detector's own first detection at start uses its clock; wait for it, then add an image that only
	// the GC's detect request will find, with the request's time.
	bustest.WaitFor(t, "detector", func() bool {
		_, err := rs.Detect(t.Context(), time.Now())
		return err == nil
	})
	rt.SetImages(makeImage(0, 100), makeImage(1, 200), makeImage(2, 300))
	freeTime := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	recs, err := rs.Detect(t.Context(), freeTime)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 3 {
		t.Fatalf("records = %d, want 3", len(recs))
	}
	if r := recs[imageID(2)]; !r.FirstDetected.Equal(freeTime) || r.Size != 300 {
		t.Errorf("image-2 = %+v, want firstDetected %v", r, freeTime)
	}
	if !recs[imageID(1)].InUse || recs[imageID(0)].InUse {
		t.Errorf("in use: image-0 %v, image-1 %v; want false, true", recs[imageID(0)].InUse, recs[imageID(1)].InUse)
	}
}

// apiRequests returns the subjects of the JetStream API requests sub received within a short quiet period.
func apiRequests(t *testing.T, sub *bus.Subscription) []string {
	t.Helper()
	var got []string
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		subject, _, err := sub.Next(ctx)
		cancel()
		if err != nil {
			return got
		}
		got = append(got, subject)
	}
}

// TestBusRecordsTakesTheRecordsFromTheDetectReply: a pass's records come with the detector's reply, so the
// pass makes no listing of the records bucket (no consumer made on its stream: before, every pass made and
// deleted one), and they are the records the bucket holds.
func TestBusRecordsTakesTheRecordsFromTheDetectReply(t *testing.T) {
	_, b := bustest.Start(t)
	rs := &busRecords{bus: b, node: testNode, timeout: 5 * time.Second}
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 200))
	rt.SetContainers(makeContainer(1))
	d, err := detector.New(detector.Config{Node: testNode, Period: time.Hour, Logger: slog.New(slog.DiscardHandler)}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	defer bustest.RunService(t, d)()
	bustest.WaitFor(t, "detector", func() bool {
		_, err := rs.Detect(t.Context(), time.Now())
		return err == nil
	})
	sub, err := b.SubscribeSync(t.Context(), "$JS.API.>")
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	apiRequests(t, sub) // whatever the start left

	rt.SetImages(makeImage(0, 100), makeImage(1, 200), makeImage(2, 300))
	freeTime := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	recs, err := rs.Detect(t.Context(), freeTime)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range apiRequests(t, sub) {
		if strings.Contains(s, "KV_"+events.RecordsBucket) {
			t.Errorf("JetStream API request %s during the pass's detect: the records were listed from the bucket", s)
		}
	}
	st, err := records.OpenStore(t.Context(), b, testNode)
	if err != nil {
		t.Fatal(err)
	}
	stored, err := st.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 3 || len(stored) != 3 {
		t.Fatalf("records = %d, stored = %d, want 3 and 3", len(recs), len(stored))
	}
	for id, want := range stored {
		got := recs[id]
		if !got.FirstDetected.Equal(want.FirstDetected) || !got.LastUsed.Equal(want.LastUsed) || got.Size != want.Size ||
			got.InUse != want.InUse || got.Pinned != want.Pinned || !slices.Equal(got.RepoTags, want.RepoTags) {
			t.Errorf("%s: from the reply %+v, in the bucket %+v", id, got, want)
		}
	}
	if r := recs[imageID(2)]; !r.FirstDetected.Equal(freeTime) {
		t.Errorf("image-2 firstDetected = %v, want the pass's freeTime %v", r.FirstDetected, freeTime)
	}
}

// TestBusRecordsFallsBackForAnEarlierDetector: a detector of an earlier release refuses WithRecords as an
// unknown field; the pass then asks as before and lists the bucket, and asks without it for a while.
func TestBusRecordsFallsBackForAnEarlierDetector(t *testing.T) {
	_, b := bustest.Start(t)
	st, err := records.OpenStore(t.Context(), b, testNode)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Write(t.Context(), []events.ImageRecord{{ID: imageID(0), Size: 100}, {ID: imageID(1), Size: 200}}, nil); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var asked []string
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		_ = b.Serve(ctx, events.CommandSubject(testNode, events.VerbDetect), events.DetectorQueue, func(_ context.Context, data []byte) (any, error) {
			mu.Lock()
			asked = append(asked, string(data))
			mu.Unlock()
			var req struct { // the request as an earlier release knew it
				Time *time.Time `json:"time,omitempty"`
			}
			if err := events.DecodeStrict(data, &req); err != nil {
				return nil, err
			}
			return events.DetectReply{Node: testNode, Records: 2}, nil
		})
	}()
	rs := &busRecords{bus: b, node: testNode, timeout: 5 * time.Second}
	var recs map[string]events.ImageRecord
	bustest.WaitFor(t, "the earlier detector", func() bool {
		recs, err = rs.Detect(t.Context(), time.Now())
		return err == nil
	})
	if len(recs) != 2 || recs[imageID(1)].Size != 200 {
		t.Fatalf("records = %+v, want the bucket's two", recs)
	}
	mu.Lock()
	n := len(asked)
	mu.Unlock()
	if _, err := rs.Detect(t.Context(), time.Now()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) != n+1 || strings.Contains(asked[n], "withRecords") {
		t.Errorf("after a refusal the next pass asked %q; want one request without withRecords", asked[n:])
	}
}
