package gctest

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/cri/critest"
)

// Records is an in-memory record source: each Detect runs records.Detect (the kubelet's detectImages) over
// the runtime, exactly as the detector worker does, and returns a copy of the records.
type Records struct {
	mu      sync.Mutex
	rt      *critest.Runtime
	records map[string]events.ImageRecord
	// now is the wall clock the detector uses for lastUsed.
	now func() time.Time
}

// NewRecords returns a record source over rt; now is the detector's clock (nil: time.Now).
func NewRecords(rt *critest.Runtime, now func() time.Time) *Records {
	if now == nil {
		now = time.Now
	}
	return &Records{rt: rt, records: map[string]events.ImageRecord{}, now: now}
}

// Detect detects with detectTime at and returns the records.
func (r *Records) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	images, err := r.rt.ListImages(ctx)
	if err != nil {
		return nil, fmt.Errorf("detect images: %w", err)
	}
	containers, err := r.rt.ListContainers(ctx)
	if err != nil {
		return nil, fmt.Errorf("detect images: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	records.Detect(r.records, images, containers, at, r.now())
	return maps.Clone(r.records), nil
}

// Get returns one record.
func (r *Records) Get(id string) (events.ImageRecord, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.records[id]
	return rec, ok
}

// Len is the number of records.
func (r *Records) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.records)
}
