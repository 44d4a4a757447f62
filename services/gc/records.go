package gc

import (
	"context"
	"errors"
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

// busRecords is the production recordSource: a detect command to the detector over NATS, whose reply
// carries the records (events.DetectRequest.WithRecords: the detector's in-memory table, what it just wrote).
// Only when the reply has no list (a node whose records do not fit in one message, or a detector that does
// not answer WithRecords: compat_plain_records.go) are the records listed from the KV bucket: a listing is an
// ordered consumer made and deleted on the records bucket's stream (two JetStream API requests, on a
// cluster both through the meta leader's Raft log, and the records delivered to it), which under load was
// the slowest step of a pass and the meta leader's work at 10,000 nodes (docs/scale.md).
type busRecords struct {
	bus     *bus.Bus
	node    string
	timeout time.Duration

	mu    sync.Mutex
	store *records.Store
	// plainDetector remembers a detector that refused WithRecords (compat_plain_records.go); guarded by mu.
	plainDetector
}

func (r *busRecords) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	withRecords := r.withRecords()
	var rep events.DetectReply
	err := r.bus.Request(ctx, events.CommandSubject(r.node, events.VerbDetect), events.DetectRequest{Time: &at, WithRecords: withRecords}, &rep)
	if withRecords && errors.Is(err, events.ErrMalformed) {
		rep, err = r.detectPlain(ctx, at) // compat_plain_records.go
	}
	if err != nil {
		return nil, fmt.Errorf("detect images: %w", err)
	}
	if rep.Listed {
		out := make(map[string]events.ImageRecord, len(rep.List))
		for _, rec := range rep.List {
			out[rec.ID] = rec
		}
		return out, nil
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
