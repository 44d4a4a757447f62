package podindex

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Service is the pod index of one node.
//
// Input: the node's pod events, read in stream order from IMAGEFLEET_PODS (which the server fills from
// IMAGEFLEET_EVENTS) with an ordered consumer that starts after the snapshot's position. Durability: a snapshot in the imagefleet-pods KV bucket
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
	cfg Config
	// What the index uses of the bus, each part declared where it is used. bus is the tail's and the gap
	// check's reading of the streams (tail.go, gap.go).
	bus     streamReader
	queries queryListener // the pods, refs and inuse queries and the podapply command
	pods    publisher     // the pod events of podapply (handle_apply.go)
	refs    refPublisher  // the registration events (transitions.go, flush.go)
	dead    deadLetterer  // malformed pod events (transitions.go)
	kv      kvOpener      // the snapshot bucket (store.go)
	state   *State
	store   *Store
	log     *slog.Logger

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
	// counts them down); until then the queries answer catchingUpText, not a state missing those events.
	caughtUp    atomic.Bool
	catchUpLeft atomic.Int64
	// sourceBehind: the events stream held more of the node's pod events than the pods stream when the tail
	// started (the server was still copying them), so only the count ends catching up.
	sourceBehind atomic.Bool
	// recounted is set once a tail stalled before catching up (only the tail goroutine uses it).
	recounted bool
	readyOnce sync.Once

	applied map[string]prometheus.Counter // eventsApplied of this node, by action

	// gaps counts the gaps seen (gap.go); gapFirst is the stream's first sequence at the last one, gapAt
	// its time in Unix nanoseconds.
	gaps, gapFirst atomic.Uint64
	gapAt          atomic.Int64
	// eventsStreamGaps (gapFirstEvents) is gapFirst for IMAGEFLEET_EVENTS, checked when a snapshot of an older
	// release moves over to the pods stream (compat_events_positions.go).
	eventsStreamGaps

	apply      applier        // serializes the podapply requests
	seqWaiters appliedWaiters // requests waiting for the applied sequence
}

// streamReader reads the node's pod events in stream order, counts those after a sequence and tells a
// stream's bounds (bus.Bus).
type streamReader interface {
	Read(ctx context.Context, stream, filter string, fn func(bus.StreamMsg) error, opts ...bus.ReadOption) error
	CountPending(ctx context.Context, stream, filter string, startSeq uint64) (uint64, error)
	Stream(ctx context.Context, name string) (bus.StreamInfo, error)
}

// queryListener serves requests on a subject in a queue group (bus.Bus).
type queryListener interface {
	Listen(ctx context.Context, subject, queue string, n int, h bus.Handler) (*bus.Listener, error)
}

// indexBus is every part of the bus the index uses (the agent passes its bus.Bus); New hands each part
// to the field that uses it.
type indexBus interface {
	streamReader
	queryListener
	publisher
	refPublisher
	deadLetterer
	kvOpener
}

// New validates cfg and builds the pod index on b.
func New(cfg Config, b indexBus) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if b == nil {
		return nil, fmt.Errorf("pod index needs a bus")
	}
	if err := registerMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	applied := map[string]prometheus.Counter{}
	for _, a := range []string{events.ActionAdded, events.ActionUpdated, events.ActionDeleted} {
		applied[a] = eventsApplied.WithLabelValues(cfg.Node, a)
	}
	s := &Service{cfg: cfg, bus: b, queries: b, pods: b, refs: b, dead: b, kv: b, state: NewState(),
		log: cfg.Logger.With("worker", "pod-index"), flushNow: make(chan struct{}, 1), ready: make(chan struct{}),
		applied: applied}
	s.backlog.Store(math.MaxUint64)
	return s, nil
}

// State is the in-memory index (for tests and benchmarks; queries go over NATS).
func (s *Service) State() *State { return s.state }

// Ready is closed once the snapshot is loaded, the index has applied the events its stream held when it
// started, and the queries are answered: their subscriptions are at the server before it closes, so a query
// sent after it finds a responder.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run answers the pods, refs and inuse queries and the podapply command (that the index is catching up,
// until it has), loads the snapshot, applies the node's pod events until ctx ends, then flushes a last
// snapshot. It returns nil after a clean shutdown.
func (s *Service) Run(ctx context.Context) error {
	// The queries are served from the start, answering that the index is catching up: while it loads its
	// snapshot, a GC pass asking for the images in use fails (and removes nothing) rather than finding no
	// pod index (no responders), which it takes for "no pod index on this node". Every subscription is made
	// here, before anything that can close Ready: made in the goroutines that serve them, one could reach
	// the server after Ready (a goroutine that lost its CPU for a few milliseconds), and the first queries
	// found no responders.
	listeners, err := s.listen(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped while it subscribed: a clean shutdown
		}
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait() // after stop (deferred calls run last first)
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	errs := make(chan error, len(listeners)+1)
	for _, l := range listeners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := l.Serve(rctx); err != nil {
				errs <- err
			}
		}()
	}

	store, err := OpenStore(ctx, s.kv, s.cfg.Node)
	if err != nil {
		return err
	}
	s.store = store
	records, applied, pos, confirmed, err := store.load(ctx)
	if err != nil {
		return err
	}
	if err := s.state.load(records, applied, pos, confirmed); err != nil {
		return fmt.Errorf("load pod index of %s: %w", s.cfg.Node, err)
	}
	pods, mirrors := s.state.Index.size()
	s.log.Info("pod index loaded", "pods", pods, "mirror_pods", mirrors, "applied_seq", applied, "pods_stream_seq", pos)
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
	if ferr := s.flushSnapshot(fctx); ferr != nil {
		s.log.Warn("final pod index flush failed", "err", ferr)
	}
	return err
}

// listen subscribes to the pods, refs and inuse queries and the podapply command; on an error it closes
// those it made.
func (s *Service) listen(ctx context.Context) ([]*bus.Listener, error) {
	subjects := []struct {
		subject string
		h       bus.Handler
	}{
		{events.QuerySubject(s.cfg.Node, events.QryPods), s.handlePods},
		{events.QuerySubject(s.cfg.Node, events.QryRefs), s.handleRefs},
		{events.QuerySubject(s.cfg.Node, events.QryInUse), s.handleInUse},
		{events.CommandSubject(s.cfg.Node, events.VerbPodApply), s.handleApply},
	}
	out := make([]*bus.Listener, 0, len(subjects))
	for _, sub := range subjects {
		l, err := s.queries.Listen(ctx, sub.subject, events.PodIndexQueue, 4, sub.h)
		if err != nil {
			for _, l := range out {
				l.Close()
			}
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}
