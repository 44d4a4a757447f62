package gc

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

const testNode = "node-1"

// Helpers named as in the kubelet's image_gc_manager_test.go.
func imageID(i int) string   { return fmt.Sprintf("image-%d", i) }
func imageName(i int) string { return fmt.Sprintf("image-%d-name", i) }
func makeImage(i int, size int64) cri.Image {
	return cri.Image{ID: imageID(i), RepoTags: []string{imageName(i)}, Size: size}
}
func makeContainer(i int) cri.Container {
	return cri.Container{ID: fmt.Sprintf("container-%d", i), ImageID: imageID(i)}
}

var zero time.Time

// harness is a collector over the in-memory runtime and records, the kubelet test's realImageGCManager.
type harness struct {
	c      *collector
	rt     *critest.Runtime
	recs   *gctest.Records
	clock  *critest.Clock
	policy Policy
	reg    *prometheus.Registry
	bus    *bus.Bus
	// capacity/available returned by statfs, or statfsErr.
	capacity, available int64
	statfsErr           error
	// lastSkipped is what the last imagesInEvictionOrder excluded.
	lastSkipped []events.GCSkipped
}

type harnessOpt func(*harness)

// withBus connects the collector to a real embedded NATS (events, pod index query).
func withBus(t *testing.T) harnessOpt {
	return func(h *harness) { _, h.bus = bustest.Start(t) }
}

func withParallelism(n int) harnessOpt { return func(h *harness) { h.c.parallelism = n } }

func withPinned(t *testing.T, patterns ...string) harnessOpt {
	return func(h *harness) {
		m, err := newRefMatcher(patterns, true)
		if err != nil {
			t.Fatal(err)
		}
		h.c.pinned = m
	}
}

func newHarness(t *testing.T, policy Policy, opts ...harnessOpt) *harness {
	t.Helper()
	h := &harness{rt: critest.NewRuntime(), clock: critest.NewClock(time.Now()), policy: policy, reg: prometheus.NewRegistry()}
	h.recs = gctest.NewRecords(h.rt, h.clock.Now)
	counter, err := newRemovedCounter(h.reg)
	if err != nil {
		t.Fatal(err)
	}
	h.c = &collector{
		node: testNode, parallelism: 1, rt: h.rt, records: h.recs, inUseTimeout: time.Second,
		// A disk: what the runtime removed is available again.
		statfs: func(string) (int64, int64, error) { return h.capacity, h.available + h.rt.RemovedBytes(), h.statfsErr },
		now:    h.clock.Now, removed: counter, log: slog.New(slog.DiscardHandler),
	}
	for _, o := range opts {
		o(h)
	}
	h.c.bus = h.bus
	return h
}

func (h *harness) pass(dryRun bool) *pass {
	return &pass{policy: h.policy, dryRun: dryRun, res: events.GCResult{Node: testNode, DryRun: dryRun}}
}

func (h *harness) detect(t *testing.T, at time.Time) {
	t.Helper()
	if _, err := h.recs.Detect(t.Context(), at); err != nil {
		t.Fatal(err)
	}
}

// imagesInEvictionOrder is the kubelet's imagesInEvictionOrder: detect at freeTime, then order.
func (h *harness) imagesInEvictionOrder(t *testing.T, freeTime time.Time) []candidate {
	t.Helper()
	recs, err := h.recs.Detect(t.Context(), freeTime)
	if err != nil {
		t.Fatal(err)
	}
	cands, skipped := evictionOrder(recs, h.c.pinned)
	h.lastSkipped = skipped
	return cands
}

// getImagesAndFreeSpace is the kubelet test helper of the same name.
func (h *harness) getImagesAndFreeSpace(t *testing.T, toFree, wantFreed int64, wantLen int, freeTime time.Time) *pass {
	t.Helper()
	cands := h.imagesInEvictionOrder(t, freeTime)
	p := h.pass(false)
	p.res.Skipped = append(p.res.Skipped, h.lastSkipped...)
	freed, err := h.c.freeSpace(t.Context(), p, toFree, freeTime, cands, ReasonSpace)
	if err != nil {
		t.Fatalf("freeSpace: %v", err)
	}
	if freed != wantFreed {
		t.Errorf("freed = %d, want %d", freed, wantFreed)
	}
	if got := h.rt.Images(); len(got) != wantLen {
		t.Errorf("images left = %v, want %d", got, wantLen)
	}
	return p
}

func (h *harness) deleteUnusedImages(t *testing.T) *pass {
	t.Helper()
	p := h.pass(false)
	if err := h.c.deleteUnusedImages(t.Context(), p); err != nil {
		t.Fatalf("DeleteUnusedImages: %v", err)
	}
	return p
}

func (h *harness) garbageCollect(ctx context.Context, beganGC time.Time) (*pass, error) {
	p := h.pass(false)
	err := h.c.garbageCollect(ctx, p, beganGC)
	return p, err
}

func (h *harness) metric(reason string) float64 {
	return testutil.ToFloat64(h.c.removed.WithLabelValues(reason))
}

// streamEvents reads every stored event of the node (as of now).
func streamEvents(t *testing.T, b *bus.Bus) []events.Event {
	t.Helper()
	var out []events.Event
	err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(testNode), func(m bus.StreamMsg) error {
		var ev events.Event
		if err := json.Unmarshal(m.Data, &ev); err != nil {
			t.Errorf("decode event: %v", err)
			return bus.StopReading
		}
		out = append(out, ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func eventsOfType(evs []events.Event, entity, action string) []events.Event {
	var out []events.Event
	for _, ev := range evs {
		if ev.Type == events.TypeName(entity, action) {
			out = append(out, ev)
		}
	}
	return out
}

func removedIDs(p *pass) []string {
	var out []string
	for _, r := range p.res.Removed {
		if r.Error == "" {
			out = append(out, r.ID)
		}
	}
	return out
}

func skippedWhy(p *pass, id string) []string {
	var out []string
	for _, s := range p.res.Skipped {
		if s.ID == id {
			out = append(out, s.Why)
		}
	}
	return out
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}
