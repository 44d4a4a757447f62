package puller

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// Requests that join a pull ride on the message of the request that started it.
//
// A pull token is a request's unacked message in the node's work queue (MaxAckPending). A request that joins
// a runtime pull another request of this process started (same image, runtime handler and credentials:
// manager.pull) needs no token of its own: the pull it waits for already holds one, its leader's message. If
// it kept its own, requests for the same image queued behind it would get a token only once the pull was
// over and then, with policy Always, pull the image again. So it gives its token back:
//
//  1. It is written into the riders record of the leader's message (the message's anchor; KV bucket
//     imagefleet-pull-records, key <node>.riders.<sha256 of the message's request id>), then its own
//     message is acked. If the write fails it keeps its token and waits as before.
//  2. The leader's message is acked only when its anchor is idle: its own request has its result, the
//     runtime pull it started has ended, and every request riding on it has published its result and left
//     the record. So while a rider waits, the message it rides on is in the work queue, unacked.
//  3. If the process dies while a request rides (or stops: riders publish nothing then and stay recorded,
//     and the leader's message is handed back), the leader's message is redelivered, after AckWait or at
//     once, to a replica or to the next start. A redelivered message's handler reads its riders record and
//     runs every request it finds there as it runs its own (adopted: they ride on this message, hold no
//     token of their own and take no place in the queue; the pull they make is counted on this message's
//     token). Each gets its events with its own request id, so a result the dead process had already
//     published is stored once by the events stream (within its 2-minute de-duplication window). A rider
//     is never lost this way, but may run twice (and, with policy Always, be pulled for twice).
//
// A rider whose result cannot be published stays recorded, and the message it rides on is redelivered
// (with the queue's backoff) instead of acked, so the rider runs again, as a request whose result could not
// be published is redelivered.
type anchor struct {
	// id is the request id of the message, which names its riders record.
	id string

	// mu guards holds and idle. It may be taken under manager.mu (manager.pull), never the reverse.
	mu sync.Mutex
	// holds counts what keeps the message unacked: its own request, the requests adopted with it, each
	// runtime pull one of those started (until it ends), each request riding on such a pull.
	holds int
	idle  chan struct{} // closed when holds drops to 0

	// wmu serializes the riders record's writes (KV calls). It is never held with manager.mu or mu.
	wmu     sync.Mutex
	riders  []rider
	written bool  // a riders record may exist in the store
	failed  error // a rider's result could not be published: the message must be redelivered
}

// rider is a request riding on another request's message, as its riders record keeps it.
type rider struct {
	Request events.PullRequest `json:"request"`
	// Deliveries is the request's delivery count when it started riding.
	Deliveries uint64 `json:"deliveries"`
}

// riderStore keeps the riders records. Records survive the process (a KV bucket); every write replaces the
// message's whole record, and an empty one removes it.
type riderStore interface {
	Riders(ctx context.Context, requestID string) ([]rider, error)
	PutRiders(ctx context.Context, requestID string, riders []rider) error
}

func newAnchor(id string) *anchor { return &anchor{id: id, holds: 1, idle: make(chan struct{})} }

func (a *anchor) hold() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.holds == 0 {
		// The message may already be acked: a caller holds an anchor only while something else holds it.
		panic("puller: hold of an idle anchor " + a.id)
	}
	a.holds++
}

func (a *anchor) release() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.holds--
	if a.holds == 0 {
		close(a.idle)
	}
}

// sole reports whether the message holds nothing but its own request.
func (a *anchor) sole() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holds == 1
}

// adopt reads the riders record of a redelivered message: the requests that rode on it in a process that
// died or stopped. They stay recorded until each has its result.
func (s *Service) adopt(ctx context.Context, a *anchor) ([]rider, error) {
	rs, err := s.riders.Riders(ctx, a.id)
	if err != nil {
		return nil, fmt.Errorf("read the requests riding on %s: %w", a.id, err)
	}
	a.wmu.Lock()
	defer a.wmu.Unlock()
	a.riders, a.written = slices.Clone(rs), len(rs) > 0
	return rs, nil
}

// park records req as riding on a's message. False: it could not be recorded (logged), and the request
// keeps its own token.
func (s *Service) park(ctx context.Context, a *anchor, req events.PullRequest, deliveries uint64) bool {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	next := append(slices.Clone(a.riders), rider{Request: req, Deliveries: deliveries})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.riders.PutRiders(wctx, a.id, next); err != nil {
		s.m.cfg.log.Warn("joined request keeps its pull token: recording it failed", "request_id", req.ID,
			"leader_request_id", a.id, "err", err)
		// The write may have landed: a later write, or the message's end, settles the record.
		a.written = true
		return false
	}
	a.riders, a.written = next, true
	return true
}

// settle takes request id off a's riders record once it has its result; err is what finishing it returned
// (a result not published, or the puller stopping), and keeps it recorded.
func (s *Service) settle(ctx context.Context, a *anchor, id string, err error) {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	if err != nil {
		if a.failed == nil {
			a.failed = fmt.Errorf("request %s riding on %s: %w", id, a.id, err)
		}
		return
	}
	next := slices.DeleteFunc(slices.Clone(a.riders), func(r rider) bool { return r.Request.ID == id })
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if werr := s.riders.PutRiders(wctx, a.id, next); werr != nil {
		// It stays recorded: only a redelivery of the message would run it again; the message's end
		// retries the removal.
		s.m.cfg.log.Warn("remove answered request from riders record failed", "request_id", id,
			"leader_request_id", a.id, "err", werr)
		a.riders = next
		return
	}
	a.riders, a.written = next, len(next) > 0
}

// failure is the first rider failure of a's message (nil: none).
func (s *Service) failure(a *anchor) error {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	return a.failed
}

// clearRiders removes a's riders record, if one may be left, before its message is acked.
func (s *Service) clearRiders(ctx context.Context, a *anchor) {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	if !a.written {
		return
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := s.riders.PutRiders(wctx, a.id, nil); err != nil {
		// Every rider has its result: a record left behind is only read if this request id is redelivered.
		s.m.cfg.log.Warn("remove riders record failed", "request_id", a.id, "err", err)
		return
	}
	a.written = false
}
