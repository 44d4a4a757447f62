package podindex

// The tail: the node's pod events read in stream order, decoded ahead on a few goroutines, applied in order.

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// tailLoop applies events until ctx ends, resuming after the last applied sequence after any error.
func (s *Service) tailLoop(ctx context.Context, errs <-chan error) error {
	delay := 100 * time.Millisecond
	for {
		err := s.tailOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		select {
		case err := <-errs:
			return err
		default:
		}
		if errors.Is(err, errRecount) {
			delay = 100 * time.Millisecond
			continue
		}
		if err != nil {
			s.log.Warn("pod events tail failed, resuming", "from_seq", s.state.Applied()+1, "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-errs:
			return err
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// decoded is a stream message and what decoding it gave.
type decoded struct {
	m   bus.StreamMsg
	ev  PodEvent
	err error
}

// decodeQueue is how many messages each decoder holds ahead of the applier.
const decodeQueue = 128

// tailOnce reads the node's pod events from the one after the last applied until ctx ends or something
// fails. Decoding (the JSON of a Pod, most of the cost of an event) runs on cfg.DecodeWorkers goroutines
// while the previous events are applied: message i goes to decoder i mod n, and the applier takes the
// results from the decoders in the same rotation, so events are applied strictly in stream order. When the
// applier fails (a dead letter that could not be stored), it stops applying and stops the tail; the next
// tail starts again at the event it could not handle. Every goroutine ends before tailOnce returns, and every
// event decoded before the tail ended is applied (they are the stream's next events, in order).
func (s *Service) tailOnce(ctx context.Context) error {
	n := s.cfg.DecodeWorkers
	tctx, stop := context.WithCancel(ctx)
	defer stop()
	in := make([]chan bus.StreamMsg, n)
	out := make([]chan decoded, n)
	var wg sync.WaitGroup
	for k := range n {
		in[k] = make(chan bus.StreamMsg, decodeQueue)
		out[k] = make(chan decoded, decodeQueue)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(out[k])
			for m := range in[k] {
				ev, err := DecodePodEvent(m.Subject, m.Header, m.Data)
				out[k] <- decoded{m: m, ev: ev, err: err}
			}
		}()
	}
	applyErr := make(chan error, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		var err error
		for i := 0; ; i = (i + 1) % n {
			d, ok := <-out[i]
			if !ok {
				break // in order: once decoder i is done, every later message was never sent
			}
			if err != nil {
				continue // drain without applying after a failure
			}
			if err = s.handleDecoded(d); err != nil {
				stop()
			}
		}
		applyErr <- err
	}()

	next := 0
	onStart := func(pending uint64) {
		s.catchUpLeft.Store(int64(min(pending, math.MaxInt64)))
		if pending == 0 {
			s.markCaughtUp()
		}
	}
	// Until caught up: when no event arrives (nor is applied) for catchUpStall, the events counted at the
	// start may be gone (expired, discarded or purged before delivery), so the count would never drain: end
	// this tail, and the next one counts again from the applied sequence.
	var delivered atomic.Uint64
	stalled := make(chan struct{})
	if !s.caughtUp.Load() {
		go func() {
			t := time.NewTicker(catchUpStall)
			defer t.Stop()
			progress := func() uint64 { return delivered.Load() + s.state.Applied() }
			last := progress()
			for !s.caughtUp.Load() {
				select {
				case <-tctx.Done():
					return
				case <-t.C:
				}
				now := progress()
				if now == last && !s.caughtUp.Load() {
					close(stalled)
					stop()
					return
				}
				last = now
			}
		}()
	}
	// A gap: events dropped from the stream before the index read them (gap.go), at the start and while the
	// tail runs (the stream can drop events ahead of a slow reader).
	s.checkGap(tctx, s.state.Applied()+1)
	var lastSeq atomic.Uint64
	lastSeq.Store(s.state.Applied())
	// prevPending is how many of the node's events followed the last delivered one: the next delivery leaves
	// at least one fewer, unless some were dropped without being delivered (a gap that is certain).
	prevPending := uint64(math.MaxUint64)
	go func() {
		t := time.NewTicker(gapCheckPeriod)
		defer t.Stop()
		for {
			select {
			case <-tctx.Done():
				return
			case <-t.C:
				// Only while behind on its own events: a caught-up index loses nothing when the stream drops
				// other events after its position.
				if b := s.backlog.Load(); b > 0 && b != math.MaxUint64 {
					s.checkGap(tctx, lastSeq.Load()+1)
				}
			}
		}
	}()
	tailErr := s.bus.TailFrom(tctx, events.EventsStream, events.PodEventSubjects(s.cfg.Node), s.state.Applied()+1, onStart,
		func(m bus.StreamMsg) error {
			delivered.Add(1)
			lastSeq.Store(m.Seq)
			if prevPending != math.MaxUint64 && prevPending > 0 && m.Pending+1 < prevPending {
				s.gapLost(m.Seq, prevPending-1-m.Pending)
			}
			prevPending = m.Pending
			select {
			case in[next] <- m:
			case <-tctx.Done():
				return tctx.Err()
			}
			next = (next + 1) % n
			return nil
		})
	for k := range n {
		close(in[k])
	}
	wg.Wait()
	if err := <-applyErr; err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil
	}
	select {
	case <-stalled:
		s.log.Info("pod events stalled before catching up; counting again", "applied_seq", s.state.Applied(),
			"counted_left", s.catchUpLeft.Load())
		return errRecount
	default:
	}
	return tailErr
}

// handleDecoded applies one decoded pod event, or dead-letters it when it did not decode; an error stops the
// tail, which resumes at the same event.
func (s *Service) handleDecoded(d decoded) error {
	if d.m.Seq != 0 && d.m.Seq <= s.state.Applied() {
		s.countCaughtUp(d.m.Pending)
		return nil // already applied (a resumed tail)
	}
	s.backlog.Store(d.m.Pending)
	var err error
	if d.err != nil {
		err = s.rejectEvent(d.m, d.err)
	} else {
		err = s.applyEvent(d.m.Seq, d.ev)
	}
	if err == nil {
		s.countCaughtUp(d.m.Pending)
		s.seqWaiters.advanced()
	}
	return err
}
