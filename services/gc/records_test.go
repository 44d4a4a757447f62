package gc

import (
	"errors"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"log/slog"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
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
