package gc

import (
	"context"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// handleGC answers imagefleet.cmd.<node>.gc. A malformed request (bad JSON, unknown fields, wrong types,
// invalid policy overrides) is answered with an error; a pass that ran is answered with its GCResult, whose
// Error holds the kubelet's text when the pass failed. A request with an id that was answered in the last
// recentTTL (or is being answered) gets that answer again, without a second pass: a fleet orchestrator whose
// reply was lost with a server asks again with the same id (events.GCRequest.ID).
func (s *Service) handleGC(ctx context.Context, data []byte) (any, error) {
	var req events.GCRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	if req.ID == "" {
		return s.gcAnswer(ctx, req)
	}
	c, first := s.recent.start(req.ID, time.Now())
	if first {
		c.res, c.err = s.gcAnswer(ctx, req)
		close(c.done)
		if c.err != nil {
			s.recent.forget(req.ID, c) // refused or cut short: a repeat may run
		}
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *Service) gcAnswer(ctx context.Context, req events.GCRequest) (any, error) {
	res, err := s.GarbageCollect(ctx, req)
	if err != nil && res.Node == "" {
		return nil, err // the request was refused before any pass ran
	}
	return res, nil
}

// recentTTL is how long the executor remembers the answer to a GC request id; recentMax bounds how many.
const (
	recentTTL = 10 * time.Minute
	recentMax = 1024
)

// recentRequests remembers the answers to GC request ids.
type recentRequests struct {
	mu    sync.Mutex
	calls map[string]*gcCall
}

type gcCall struct {
	at   time.Time
	done chan struct{}
	res  any
	err  error
}

// start returns the call for id and whether the caller is the first (and must run it and close done).
func (r *recentRequests) start(id string, now time.Time) (*gcCall, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.calls == nil {
		r.calls = map[string]*gcCall{}
	}
	if c, ok := r.calls[id]; ok && now.Sub(c.at) < recentTTL {
		return c, false
	}
	for k, c := range r.calls {
		if now.Sub(c.at) >= recentTTL {
			delete(r.calls, k)
		}
	}
	if len(r.calls) >= recentMax {
		// Drop the oldest finished answer (a burst of over recentMax ids in recentTTL is not a fleet's pace).
		var oldest string
		for k, c := range r.calls {
			select {
			case <-c.done:
				if oldest == "" || c.at.Before(r.calls[oldest].at) {
					oldest = k
				}
			default:
			}
		}
		delete(r.calls, oldest)
	}
	c := &gcCall{at: now, done: make(chan struct{})}
	r.calls[id] = c
	return c, true
}

func (r *recentRequests) forget(id string, c *gcCall) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.calls[id] == c {
		delete(r.calls, id)
	}
}
