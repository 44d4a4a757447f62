package controller

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
)

// recordingWriter records the status patches and counts those in flight at once; the first one waits for
// release.
type recordingWriter struct {
	client.SubResourceWriter
	mu       sync.Mutex
	patches  []string // the patched phases, in the order the patches landed
	inFlight int
	overlap  bool
	first    chan struct{} // closed when the first patch is in flight
	release  chan struct{}
	calls    int
}

func (w *recordingWriter) Patch(_ context.Context, _ client.Object, p client.Patch, _ ...client.SubResourcePatchOption) error {
	w.mu.Lock()
	w.calls++
	call := w.calls
	w.inFlight++
	if w.inFlight > 1 {
		w.overlap = true
	}
	w.mu.Unlock()
	if call == 1 {
		close(w.first)
		<-w.release
	}
	raw, err := p.Data(nil)
	if err != nil {
		return err
	}
	var body struct {
		Status v1alpha1.RolloutStatus `json:"status"`
	}
	if err := json.Unmarshal(raw, &body); err != nil {
		return err
	}
	w.mu.Lock()
	w.patches = append(w.patches, body.Status.Phase)
	w.inFlight--
	w.mu.Unlock()
	return nil
}

// TestStatusWritesLandInOrder: the flusher's periodic write and the final write never overlap, so the last
// status written is the newest (two writes in flight at once could land the older last: an object left
// Running after its Complete was written).
func TestStatusWritesLandInOrder(t *testing.T) {
	w := &recordingWriter{first: make(chan struct{}), release: make(chan struct{})}
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r := &reconciler{kind: gcKind(), status: w, m: m, log: slog.New(slog.DiscardHandler), cfg: Config{StatusInterval: time.Hour}}
	obj := &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc", UID: "u"}}
	run := newRunner(t.Context(), r, obj)

	run.mu.Lock()
	run.status.Phase = v1alpha1.PhaseRunning
	run.markLocked(false)
	run.mu.Unlock()
	firstDone := make(chan error, 1)
	go func() { firstDone <- run.flush(t.Context()) }() // the flusher's write of Running, held in flight
	<-w.first

	run.mu.Lock()
	run.status.Phase = v1alpha1.PhaseComplete
	run.markLocked(false)
	run.mu.Unlock()
	secondDone := make(chan error, 1)
	go func() { secondDone <- run.flush(t.Context()) }() // the final write of Complete
	// Negative check: give the final write time to reach the API server while the first is in flight.
	time.Sleep(200 * time.Millisecond)
	close(w.release)
	if err := <-firstDone; err != nil {
		t.Fatal(err)
	}
	if err := <-secondDone; err != nil {
		t.Fatal(err)
	}
	if w.overlap || len(w.patches) != 2 || w.patches[1] != v1alpha1.PhaseComplete {
		t.Errorf("patches landed %v (overlapping: %v): want Running then Complete, one at a time", w.patches, w.overlap)
	}
}

// TestRecordCountsEachNodeOnce: a resumed rollout reports its earlier outcomes again; each node counts once,
// with its latest outcome, and the GC sums follow.
func TestRecordCountsEachNodeOnce(t *testing.T) {
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r := &reconciler{kind: gcKind(), status: &recordingWriter{}, m: m, log: slog.New(slog.DiscardHandler),
		rec: discardRecorder{}, cfg: Config{StatusInterval: time.Hour}}
	run := newRunner(t.Context(), r, &v1alpha1.ImageGC{ObjectMeta: metav1.ObjectMeta{Name: "gc", UID: "u"}})
	run.status.Desired = 3
	gc := func(node string, ok bool, bytes int64) events.RolloutNodeResult {
		return events.RolloutNodeResult{Node: node, OK: ok, GCCounts: &events.GCCounts{Removed: 1, Bytes: bytes}}
	}
	for _, nr := range []events.RolloutNodeResult{gc("a", true, 10), gc("b", true, 20), gc("a", true, 10), gc("c", false, 0), gc("b", true, 20)} {
		run.record(nr)
	}
	st := run.status
	if st.Succeeded != 2 || st.Failed != 1 || st.BytesFreed != 30 || st.ImagesRemoved != 3 || st.Progress != "3/3" {
		t.Errorf("status %+v: want 2 succeeded, 1 failed, 30 bytes and 3 images (c's count included), 3/3", st)
	}
}

// discardRecorder drops Events.
type discardRecorder struct{ recorder.EventRecorder }

func (discardRecorder) Eventf(runtime.Object, runtime.Object, string, string, string, string, ...any) {
}
