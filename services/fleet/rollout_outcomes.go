package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// outcomeLog records node outcomes in groups (events.RolloutNodes), a group commit: one record is written
// at a time, and the outcomes that end while it is written make up the next. A node's outcome is recorded
// before record returns, as with a record per node; a rollout with many nodes in flight writes a record per
// round trip to the stream instead of one per node, and one with few writes one per node.
type outcomeLog struct {
	r       *Rollout
	mu      sync.Mutex
	pending []pendingOutcome
	wake    chan struct{}
	seq     int
	ended   error // set, under mu, once the writer has ended: record fails with it at once
}

// pendingOutcome is an outcome waiting for its group's write; done receives the write's error.
type pendingOutcome struct {
	raw  json.RawMessage
	done chan error
}

// Group limits: a record holds at most outcomeGroupNodes outcomes and outcomeGroupBytes of them (a dry
// run's outcome lists its images: a few KiB), far below the server's 1 MiB message limit. An outcome larger
// than outcomeGroupBytes is a group of its own.
const (
	outcomeGroupNodes = 1000
	outcomeGroupBytes = 128 << 10
)

// startOutcomeLog starts the writer; it ends with ctx, failing what is still pending with ctx's error.
func (r *Rollout) startOutcomeLog(ctx context.Context) *outcomeLog {
	o := &outcomeLog{r: r, wake: make(chan struct{}, 1)}
	go o.run(ctx)
	return o
}

// record stores nr in the next group and returns once that group is written (or failed to be).
func (o *outcomeLog) record(nr events.RolloutNodeResult) error {
	raw, err := json.Marshal(nr)
	if err != nil {
		return fmt.Errorf("marshal outcome of node %s: %w", nr.Node, err)
	}
	p := pendingOutcome{raw: raw, done: make(chan error, 1)}
	o.mu.Lock()
	if o.ended != nil {
		o.mu.Unlock()
		return o.ended
	}
	o.pending = append(o.pending, p)
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
	return <-p.done
}

func (o *outcomeLog) run(ctx context.Context) {
	for {
		select {
		case <-o.wake:
		case <-ctx.Done():
			o.mu.Lock()
			o.ended = ctx.Err()
			o.mu.Unlock()
			for _, p := range o.take(true) {
				p.done <- ctx.Err()
			}
			return
		}
		for group := o.take(false); len(group) > 0; group = o.take(false) {
			err := o.write(ctx, group)
			for _, p := range group {
				p.done <- err
			}
		}
	}
}

// take removes the next group from pending (all of it when all is set).
func (o *outcomeLog) take(all bool) []pendingOutcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	n, size := 0, 0
	for n < len(o.pending) && (all || n < outcomeGroupNodes) {
		if !all && n > 0 && size+len(o.pending[n].raw) > outcomeGroupBytes {
			break
		}
		size += len(o.pending[n].raw)
		n++
	}
	group := o.pending[:n:n]
	o.pending = o.pending[n:]
	return group
}

// write stores one group: retried like every outcome record (recordRetryFor), idempotent by its message id.
func (o *outcomeLog) write(ctx context.Context, group []pendingOutcome) error {
	o.seq++
	// events.RolloutNodes, written around the outcomes as each node's goroutine marshalled them: the one
	// writer does not encode (nor, as json.Marshal does with a RawMessage, scan again) any outcome.
	owner, err := json.Marshal(o.r.owner)
	if err != nil {
		return fmt.Errorf("marshal %d outcomes: %w", len(group), err)
	}
	size := len(owner) + 32
	for _, p := range group {
		size += len(p.raw) + 1
	}
	data := make([]byte, 0, size)
	data = append(append(append(data, `{"owner":`...), owner...), `,"nodes":[`...)
	for i, p := range group {
		if i > 0 {
			data = append(data, ',')
		}
		data = append(data, p.raw...)
	}
	data = append(data, `]}`...)
	cfg := o.r.cfg
	subject := events.RolloutNodesSubject(cfg.ID, o.r.owner, o.seq)
	msg := bus.RawMsg{Subject: subject, MsgID: cfg.ID + ".nodes." + o.r.owner + "." + strconv.Itoa(o.seq), Data: data,
		Header: map[string]string{"content-type": "application/json"}}
	err = bus.Retry(ctx, func(ctx context.Context) error {
		_, err := o.r.b.PublishStored(ctx, msg)
		return err
	}, bus.MaxElapsed(recordRetryFor), bus.MaxWait(time.Second))
	if err != nil {
		return fmt.Errorf("record %d outcomes: %w", len(group), err)
	}
	return nil
}
