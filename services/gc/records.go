package gc

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
)

// recordSource detects images now and returns the node's records, keyed by image ID. The detector is the
// single writer of records: the GC executor asks it to detect (with the pass's freeTime as detect time, as
// the kubelet's imagesInEvictionOrder does) and reads what it wrote.
type recordSource interface {
	Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error)
}

// busRecords is the production recordSource: a detect command to the detector over NATS, then the records
// from the KV bucket.
type busRecords struct {
	bus     *bus.Bus
	node    string
	timeout time.Duration

	mu    sync.Mutex
	store *records.Store
}

func (r *busRecords) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	var rep events.DetectReply
	if err := r.bus.Request(ctx, events.CommandSubject(r.node, events.VerbDetect), events.DetectRequest{Time: &at}, &rep); err != nil {
		return nil, fmt.Errorf("detect images: %w", err)
	}
	r.mu.Lock()
	if r.store == nil {
		st, err := records.OpenStore(ctx, r.bus, r.node)
		if err != nil {
			r.mu.Unlock()
			return nil, fmt.Errorf("detect images: %w", err)
		}
		r.store = st
	}
	st := r.store
	r.mu.Unlock()
	return st.Load(ctx)
}
