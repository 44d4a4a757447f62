package podindex

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Consumer is the pod index's name in dead letters (imagefleet.dlq.IMAGEFLEET_EVENTS.pod-index-<node>).
const Consumer = events.PodIndexQueue

// Service is the pod index of one node.
//
// Input: the node's pod events, read in stream order from IMAGEFLEET_EVENTS with an ordered consumer that
// starts after the snapshot's applied sequence. Durability: a snapshot in the imagefleet-pods KV bucket
// (every changed pod, then the applied sequence), written every FlushInterval while the index keeps up, less
// often while it catches up (see Config), and at shutdown. After a
// restart of the worker or of NATS, the snapshot is loaded and the events after its sequence are replayed;
// since the state is a function of its pods, and every pod record in the bucket is at least as new as the
// sequence (pods are written before the sequence), the result equals a run without the restart.
// The stream alone is not enough (it keeps events 7 days and 1 GiB), so the snapshot is the source of truth
// and the stream the log after it.
//
// Lock order: Service.mu, then State's locks.
type Service struct {
	cfg   Config
	bus   *bus.Bus
	state *State
	store *Store
	log   *slog.Logger

	// mu is held while an event is applied and its transition events are queued, and while a flush takes the
	// dirty pods and the queue, so a flush never writes pods whose transition events are not yet stored.
	mu        sync.Mutex
	pending   []pendingEvents
	since     int       // events applied since the last snapshot write
	flushed   uint64    // the applied sequence of the last snapshot written
	lastWrite time.Time // when the last snapshot was written (or the index started)
	writeNow  bool      // a dead letter asks for the next flush to write the snapshot

	// backlog is how many of the node's pod events followed the last applied one in the stream when it was
	// delivered: the index is catching up while it is over catchUpBacklog. Unknown until the first event is
	// delivered: MaxUint64, catching up (a flush before then must not write a snapshot the replay overtakes).
	backlog atomic.Uint64

	flushNow chan struct{}
	ready    chan struct{}
	// caughtUp is set once the index applied every event its stream held when it started (catchUpLeft
	// counts them down); until then the queries answer CatchingUpText, not a state missing those events.
	caughtUp    atomic.Bool
	catchUpLeft atomic.Int64
	readyOnce   sync.Once

	applied map[string]prometheus.Counter // eventsApplied of this node, by action

	apply      applier        // serializes the podapply requests
	seqWaiters appliedWaiters // requests waiting for the applied sequence
}

// pendingEvents are transition events published asynchronously and not yet confirmed.
type pendingEvents struct {
	evs []events.Event
	p   *bus.Pending
}

// New validates cfg and builds the pod index.
func New(cfg Config, b *bus.Bus) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if b == nil {
		return nil, fmt.Errorf("pod index needs a bus")
	}
	applied := map[string]prometheus.Counter{}
	for _, a := range []string{events.ActionAdded, events.ActionUpdated, events.ActionDeleted} {
		applied[a] = eventsApplied.WithLabelValues(cfg.Node, a)
	}
	s := &Service{cfg: cfg, bus: b, state: NewState(), log: cfg.Logger.With("worker", "pod-index"),
		flushNow: make(chan struct{}, 1), ready: make(chan struct{}), applied: applied}
	s.backlog.Store(math.MaxUint64)
	return s, nil
}

// State is the in-memory index (for tests and benchmarks; queries go over NATS).
func (s *Service) State() *State { return s.state }

// Ready is closed once the snapshot is loaded, the index has applied the events its stream held when it
// started, and the queries are answered.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run answers the pods, refs and inuse queries (that it is catching up, until it has), loads the snapshot,
// applies the node's pod events until ctx ends, then flushes a last snapshot. It returns nil after a clean
// shutdown.
func (s *Service) Run(ctx context.Context) error {
	// The queries are served from the start, answering that the index is catching up: while it loads its
	// snapshot, a GC pass asking for the images in use fails (and removes nothing) rather than finding no
	// pod index (no responders), which it takes for "no pod index on this node".
	var wg sync.WaitGroup
	defer wg.Wait() // after stop (deferred calls run last first)
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	errs := make(chan error, 5)
	serve := func(what string, h bus.Handler) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.bus.ServeConcurrent(rctx, events.QuerySubject(s.cfg.Node, what), Consumer, 4, h); err != nil {
				errs <- err
			}
		}()
	}
	serve(events.QryPods, s.HandlePods)
	serve(events.QryRefs, s.HandleRefs)
	serve(events.QryInUse, s.HandleInUse)
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := s.bus.ServeConcurrent(rctx, events.CommandSubject(s.cfg.Node, events.VerbPodApply), events.PodIndexQueue, 4, s.handleApply); err != nil {
			errs <- err
		}
	}()

	store, err := OpenStore(ctx, s.bus, s.cfg.Node)
	if err != nil {
		return err
	}
	s.store = store
	records, applied, err := store.Load(ctx)
	if err != nil {
		return err
	}
	if err := s.state.Load(records, applied); err != nil {
		return fmt.Errorf("load pod index of %s: %w", s.cfg.Node, err)
	}
	pods, mirrors := s.state.Index.Len()
	s.log.Info("pod index loaded", "pods", pods, "mirror_pods", mirrors, "applied_seq", applied)
	s.mu.Lock()
	s.lastWrite = time.Now()
	s.mu.Unlock()

	wg.Add(1)
	go func() {
		defer wg.Done()
		s.flushLoop(rctx)
	}()

	err = s.tailLoop(ctx, errs)
	stop()
	wg.Wait()
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if ferr := s.Flush(fctx); ferr != nil {
		s.log.Warn("final pod index flush failed", "err", ferr)
	}
	return err
}

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
	tailErr := s.bus.TailFrom(tctx, events.EventsStream, events.PodEventSubjects(s.cfg.Node), s.state.Applied()+1, onStart,
		func(m bus.StreamMsg) error {
			delivered.Add(1)
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

// catchUpStall is how long the tail may deliver nothing before the index has caught up, before it counts
// again what is left (a variable for tests).
var catchUpStall = 2 * time.Second

// errRecount ends a tail that stalled before catching up: tailLoop starts the next one at once.
var errRecount = errors.New("recount the events left to catch up")

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
		err = s.Reject(d.m, d.err)
	} else {
		err = s.Apply(d.m.Seq, d.ev)
	}
	if err == nil {
		s.countCaughtUp(d.m.Pending)
		s.seqWaiters.advanced()
	}
	return err
}

// countCaughtUp counts one handled event towards catching up: the index is caught up once it handled as
// many as its stream held when the tail started, or an event had none after it.
func (s *Service) countCaughtUp(pending uint64) {
	if s.caughtUp.Load() {
		return
	}
	if s.catchUpLeft.Add(-1) <= 0 || pending == 0 {
		s.markCaughtUp()
	}
}

// markCaughtUp opens the queries and closes Ready.
func (s *Service) markCaughtUp() {
	s.readyOnce.Do(func() {
		s.caughtUp.Store(true)
		pods, mirrors := s.state.Index.Len()
		s.log.Info("pod index caught up", "pods", pods, "mirror_pods", mirrors, "applied_seq", s.state.Applied())
		close(s.ready)
	})
}

// CatchingUpText is the error the queries answer until the index has applied the events its stream held
// when it started: a state without them could say a pod is absent (so its images unused) when it is not.
const CatchingUpText = "the pod index is catching up with its events"

// errCatchingUp is the queries' answer before the index caught up.
func (s *Service) errCatchingUp() error {
	if s.caughtUp.Load() {
		return nil
	}
	return fmt.Errorf("%s (applied up to stream sequence %d, %d events to go)", CatchingUpText,
		s.state.Applied(), max(s.catchUpLeft.Load(), 0))
}

// IsCatchingUp reports whether err is a query's answer from a pod index that has not caught up yet.
func IsCatchingUp(err error) bool {
	return errors.Is(err, bus.ErrRemote) && strings.Contains(err.Error(), CatchingUpText)
}

// Reject dead-letters a malformed event with its reason, counts it and moves past it.
func (s *Service) Reject(m bus.StreamMsg, reason error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.bus.DeadLetterMsg(ctx, events.EventsStream, events.PodIndexDeadLetters(s.cfg.Node), m, reason); err != nil {
		return err
	}
	eventsRejected.WithLabelValues(s.cfg.Node, RejectReason(reason)).Inc()
	s.log.Warn("pod event rejected", "subject", m.Subject, "stream_seq", m.Seq, "err", reason)
	s.state.Skip(m.Seq)
	s.mu.Lock()
	s.writeNow = true // the snapshot moves past it, so a restart does not dead-letter it again
	s.mu.Unlock()
	s.requestFlush()
	return nil
}

// Apply applies one decoded event with stream sequence seq and publishes its registration events.
func (s *Service) Apply(seq uint64, ev PodEvent) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	trans := s.state.Apply(seq, ev)
	if c, ok := s.applied[ev.Action]; ok {
		c.Inc()
	} else {
		eventsApplied.WithLabelValues(s.cfg.Node, ev.Action).Inc()
	}
	s.since++
	if len(trans) > 0 {
		evs := make([]events.Event, 0, len(trans))
		for _, t := range trans {
			evs = append(evs, s.transitionEvent(seq, ev, t))
		}
		p, err := s.bus.PublishAsync(evs)
		if err != nil {
			// Kept pending: the next flush publishes them again before it writes the snapshot.
			s.log.Warn("registration events publish failed", "stream_seq", seq, "err", err)
		}
		s.pending = append(s.pending, pendingEvents{evs: evs, p: p})
	}
	if s.since >= s.cfg.FlushEvents || len(s.pending) >= 512 {
		s.requestFlush()
	}
	return nil
}

// transitionEvent builds secret.registered (and the other three). Its id is derived from the pod event's
// sequence and the object, so replaying an event after a restart stores the same event once.
func (s *Service) transitionEvent(seq uint64, ev PodEvent, t Transition) events.Event {
	entity, action := events.EntitySecret, events.ActionUnregistered
	if t.Kind == events.KindConfigMap {
		entity = events.EntityConfigMap
	}
	count := 0
	if t.Registered {
		action, count = events.ActionRegistered, 1
	}
	refTransitions.WithLabelValues(s.cfg.Node, t.Kind, action).Inc()
	data := events.RefChange{Kind: t.Kind, Namespace: t.Namespace, Name: t.Name, Count: count,
		PodUID: string(t.Pod.uid), PodName: t.Pod.name, StreamSeq: seq}
	e, _ := events.New(s.cfg.Node, entity, action, data) // a RefChange always marshals
	h := sha256.Sum256([]byte(s.cfg.Node + "\x00" + strconv.FormatUint(seq, 10) + "\x00" + t.Kind + "\x00" +
		t.Namespace + "\x00" + t.Name + "\x00" + action + "\x00" + string(t.Pod.uid)))
	e.ID = hex.EncodeToString(h[:16])
	reason, msg := "Registered", fmt.Sprintf("%s %s/%s registered: first referenced by pod %s/%s", t.Kind,
		t.Namespace, t.Name, t.Pod.namespace, t.Pod.name)
	if !t.Registered {
		reason, msg = "Unregistered", fmt.Sprintf("%s %s/%s unregistered: no longer referenced (last by pod %s/%s)",
			t.Kind, t.Namespace, t.Name, t.Pod.namespace, t.Pod.name)
	}
	return e.WithKube("", reason, msg, &events.ObjectRef{Kind: "Pod", Namespace: t.Pod.namespace, Name: t.Pod.name, UID: string(t.Pod.uid)})
}

func (s *Service) requestFlush() {
	select {
	case s.flushNow <- struct{}{}:
	default:
	}
}

func (s *Service) flushLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.FlushInterval)
	defer tick.Stop()
	// While NATS is away every flush fails the same way: said once, until a flush succeeds or fails otherwise.
	saidNotConnected := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.flushNow:
		}
		err := s.flush(ctx, s.snapshotDue(time.Now()))
		var say bool
		if say, saidNotConnected = sayFlushError(err, ctx.Err() != nil, saidNotConnected); say {
			s.log.Warn("pod index flush failed", "err", err)
		}
	}
}

// sayFlushError decides whether a flush's error is logged: not when shutting down, and "not connected" only
// the first time in a row (NATS is away: every flush fails so until it is back). It returns whether this
// error is a "not connected" already said, for the next call.
func sayFlushError(err error, shuttingDown, saidNotConnected bool) (say, said bool) {
	notConnected := errors.Is(err, errNotConnected)
	return err != nil && !shuttingDown && !(notConnected && saidNotConnected), notConnected
}

// catchUpBacklog is the backlog (events after the last applied one) over which the index is catching up.
const catchUpBacklog = 1000

// snapshotDue reports whether a flush at now writes the snapshot, or only confirms the registration events
// published since the last one (see Config.FlushEvents).
func (s *Service) snapshotDue(now time.Time) bool {
	s.mu.Lock()
	since, elapsed, forced := s.since, now.Sub(s.lastWrite), s.writeNow
	s.mu.Unlock()
	return snapshotPolicy{s.cfg.FlushInterval, s.cfg.FlushEvents, s.cfg.FlushMaxDelay}.due(
		s.backlog.Load(), since, elapsed, forced)
}

// snapshotPolicy decides when the snapshot is written.
type snapshotPolicy struct {
	interval time.Duration
	events   int
	maxDelay time.Duration
}

// due: always after a dead letter, after p.events events or p.maxDelay; and, while the index keeps up (a
// backlog of at most catchUpBacklog events), once p.interval passed (half of it, so a flush the ticker
// brings a little early still writes).
func (p snapshotPolicy) due(backlog uint64, since int, elapsed time.Duration, forced bool) bool {
	switch {
	case forced, since >= p.events, elapsed >= p.maxDelay:
		return true
	default:
		return backlog <= catchUpBacklog && elapsed >= p.interval/2
	}
}

var errNotConnected = errors.New("not connected to nats")

// Flush confirms the queued registration events, then writes the changed pods and the applied sequence.
func (s *Service) Flush(ctx context.Context) error { return s.flush(ctx, true) }

// flush confirms the queued registration events and, when write is set, writes the snapshot.
func (s *Service) flush(ctx context.Context, write bool) error {
	if s.store == nil {
		return nil // not running
	}
	if !s.bus.Connected() {
		// Acks cannot come: keep everything dirty for the next flush (or the replay after a restart).
		return fmt.Errorf("flush pod index of %s: %w", s.cfg.Node, errNotConnected)
	}
	s.mu.Lock()
	var d Dirty
	var err error
	if write {
		d, err = s.state.TakeDirty()
		s.since, s.writeNow = 0, false
	}
	pending := s.pending
	s.pending = nil
	s.mu.Unlock()
	if err != nil {
		return err
	}
	restore := func() {
		s.mu.Lock()
		s.pending = append(pending, s.pending...)
		s.writeNow = s.writeNow || write
		s.mu.Unlock()
		if write {
			s.state.Redirty(d)
		}
	}
	for i, pe := range pending {
		if pe.p != nil && pe.p.Wait(ctx) == nil {
			continue
		}
		// Not confirmed: publish again (same ids, so stored once).
		if err := s.bus.PublishAll(ctx, pe.evs); err != nil {
			pending = pending[i:]
			restore()
			return fmt.Errorf("publish registration events: %w", err)
		}
	}
	pending = nil
	if !write || len(d.Puts)+len(d.Deletes) == 0 && d.Applied == s.flushedSeq() {
		return nil
	}
	if err := s.store.Write(ctx, d); err != nil {
		restore()
		return err
	}
	s.setFlushed(d.Applied, time.Now())
	return nil
}

func (s *Service) flushedSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.flushed
}

func (s *Service) setFlushed(seq uint64, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushed, s.lastWrite = seq, at
}
