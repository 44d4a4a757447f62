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
// Only when the reply has no list (a node whose records do not fit in one message, or a detector of an
// earlier release) are the records listed from the KV bucket, as every pass did before: a listing is an
// ordered consumer made and deleted on the records bucket's stream (two JetStream API requests, on a
// cluster both through the meta leader's Raft log, and the records delivered to it), which under load was
// the slowest step of a pass and the meta leader's work at 10,000 nodes (docs/scale.md).
type busRecords struct {
	bus     *bus.Bus
	node    string
	timeout time.Duration

	mu    sync.Mutex
	store *records.Store
	// plainUntil: a detector refused WithRecords (an earlier release); ask without it until then.
	plainUntil time.Time
}

// plainFor is how long busRecords asks without WithRecords after a detector refused it (a rolling upgrade
// replaces it within minutes).
const plainFor = 10 * time.Minute

func (r *busRecords) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	r.mu.Lock()
	withRecords := time.Now().After(r.plainUntil)
	r.mu.Unlock()
	var rep events.DetectReply
	err := r.bus.Request(ctx, events.CommandSubject(r.node, events.VerbDetect), events.DetectRequest{Time: &at, WithRecords: withRecords}, &rep)
	if withRecords && errors.Is(err, events.ErrMalformed) {
		// A detector that does not know WithRecords: it detected nothing; ask as before.
		r.mu.Lock()
		r.plainUntil = time.Now().Add(plainFor)
		r.mu.Unlock()
		rep = events.DetectReply{}
		err = r.bus.Request(ctx, events.CommandSubject(r.node, events.VerbDetect), events.DetectRequest{Time: &at}, &rep)
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
