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
	m   bus.StreamMsg // m.Seq is the event's IMAGEFLEET_EVENTS sequence
	pos uint64        // its IMAGEFLEET_PODS sequence
	ev  PodEvent
	err error
}

// errNoOrigin refuses a message of the pods stream without the events stream sequence the server stamps on
// what it sources (the index orders and snapshots by that sequence).
var errNoOrigin = errors.New("no " + events.EventsStream + " sequence in its Nats-Stream-Source header")

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
	in := make([]chan decoded, n)
	out := make([]chan decoded, n)
	var wg sync.WaitGroup
	for k := range n {
		in[k] = make(chan decoded, decodeQueue)
		out[k] = make(chan decoded, decodeQueue)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(out[k])
			for d := range in[k] {
				if d.m.Seq == 0 {
					d.err = errNoOrigin
				} else {
					d.ev, d.err = DecodePodEvent(d.m.Subject, d.m.Header, d.m.Data)
				}
				out[k] <- d
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

	// Catching up counts the node's pod events after the snapshot in the pods stream and in the events
	// stream, and waits for the larger count: the server copies events into the pods stream a little after
	// they are stored (the whole of the events stream's pod events when the pods stream is new), so the
	// pods stream alone can count too few. After a stall (events counted that never came: dropped or purged
	// from the pods stream, which the events stream may still hold) it counts the pods stream alone.
	var inEvents uint64
	if !s.caughtUp.Load() && !s.recounted {
		n, err := s.bus.CountPending(tctx, events.EventsStream, events.PodEventSubjects(s.cfg.Node), s.state.Applied()+1)
		if err != nil {
			s.log.Warn("counting the pod events of the events stream failed; counting the pods stream's alone", "err", err)
		}
		inEvents = n
	}
	next := 0
	onStart := func(pending uint64) {
		s.sourceBehind.Store(inEvents > pending)
		pending = max(pending, inEvents)
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
	// The watchers (the stall watcher, the gap checker) end with tctx: tailOnce cancels it and waits for them
	// before it returns.
	var watchers sync.WaitGroup
	if !s.caughtUp.Load() {
		watchers.Add(1)
		go func() {
			defer watchers.Done()
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
	// The tail reads IMAGEFLEET_PODS from the position after the snapshot's. A snapshot without one (an
	// older release's, which read IMAGEFLEET_EVENTS) reads the node's pod events there from the start,
	// skipping those up to its applied IMAGEFLEET_EVENTS sequence (handleDecoded), so the move loses and
	// repeats nothing.
	pos := s.state.Pos()
	if info, err := s.bus.Stream(tctx, events.PodsStream); err == nil && info.LastSeq < pos {
		s.log.Warn("the pods stream is behind the snapshot's position (recreated?): reading it from the start",
			"pods_stream_seq", pos, "stream_last_seq", info.LastSeq)
		pos = 0
	}
	// A gap: events dropped from the stream before the index read them (gap.go), at the start and while the
	// tail runs (the stream can drop events ahead of a slow reader). Moving over from an older release's
	// snapshot, what matters is whether the events stream still held the events after its applied sequence
	// (the pods stream copied what it held).
	if applied := s.state.Applied(); pos == 0 && applied > 0 {
		s.checkGap(tctx, events.EventsStream, applied+1, &s.gapFirstEvents)
	} else {
		s.checkGap(tctx, events.PodsStream, pos+1, &s.gapFirst)
	}
	var lastSeq atomic.Uint64
	lastSeq.Store(pos)
	// prevPending is how many of the node's events followed the last delivered one: the next delivery leaves
	// at least one fewer, unless some were dropped without being delivered (a gap that is certain).
	prevPending := uint64(math.MaxUint64)
	watchers.Add(1)
	go func() {
		defer watchers.Done()
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
					s.checkGap(tctx, events.PodsStream, lastSeq.Load()+1, &s.gapFirst)
				}
			}
		}
	}()
	tailErr := s.bus.Read(tctx, events.PodsStream, events.PodEventSubjects(s.cfg.Node),
		func(m bus.StreamMsg) error {
			delivered.Add(1)
			prev := lastSeq.Swap(m.Seq)
			d := decoded{m: m, pos: m.Seq}
			d.m.Seq, d.m.Origin = m.Origin, 0
			if prevPending != math.MaxUint64 && prevPending > 0 && m.Pending+1 < prevPending {
				s.gapLost(prev, m.Seq, prevPending-1-m.Pending)
			}
			prevPending = m.Pending
			select {
			case in[next] <- d:
			case <-tctx.Done():
				return tctx.Err()
			}
			next = (next + 1) % n
			return nil
		}, bus.Follow(), bus.From(pos+1), bus.OnStart(onStart))
	for k := range n {
		close(in[k])
	}
	wg.Wait()
	stop()
	watchers.Wait()
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
		s.recounted = true
		return errRecount
	default:
	}
	return tailErr
}

// handleDecoded applies one decoded pod event, or dead-letters it when it did not decode; an error stops the
// tail, which resumes at the same event.
func (s *Service) handleDecoded(d decoded) error {
	if d.m.Seq != 0 && d.m.Seq <= s.state.Applied() {
		s.state.setPos(d.pos)
		s.countCaughtUp(d.m.Pending)
		return nil // already applied (a resumed tail, or one moving over from IMAGEFLEET_EVENTS)
	}
	s.backlog.Store(d.m.Pending)
	var err error
	if d.err != nil {
		err = s.rejectEvent(d.m, d.err)
	} else {
		err = s.applyEvent(d.m.Seq, d.ev)
	}
	if err == nil {
		s.state.setPos(d.pos)
		s.countCaughtUp(d.m.Pending)
		s.seqWaiters.advanced()
	}
	return err
}
