package detector

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/cri"
)

// runtime is the part of the CRI client the detector needs.
type runtime interface {
	ListImages(ctx context.Context) ([]cri.Image, error)
	ListContainers(ctx context.Context) ([]cri.Container, error)
}

// Service is the detector worker of one node.
type Service struct {
	cfg   Config
	rt    runtime
	bus   *bus.Bus
	store *records.Store

	// mu (a one-slot semaphore, taken with lock) serialises detections and guards records (the in-memory
	// copy of the store) and unpublished. A detect command waiting for it gives up when its own deadline
	// ends, and what runs under it (a records load or write, a publish) has a deadline of its own: see call
	// and flush.
	mu          chan struct{}
	records     *records.Table
	loaded      bool
	unpublished []events.Event // events of earlier detections whose publish failed, oldest first
	// inDoubt holds the added and removed records of detections whose records write failed. A failed write
	// may have landed all the same (its last attempt's ack lost to a timeout): the next detection would then
	// find nothing new and their events would never be published. The next load settles them (settle).
	inDoubt records.Changes
	// storeWrite, when set, replaces store.Write (tests: a write that lands but reports a failure).
	storeWrite func(ctx context.Context, puts []events.ImageRecord, deletes []string) error
	// retry (one slot) tells Run that a publish failed: Run retries unpublished on its own schedule
	// (retryWait), not only at the next detection.
	retry chan struct{}

	// Events between detections (pull.pulled, image.removed): wake the loop; removedIDs waits for it.
	evMu       sync.Mutex
	removedIDs []string
	pulled     bool
	wake       chan struct{}

	// ready is closed once the subscriptions are at the server and a detection has succeeded (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

// New validates cfg and builds the detector.
func New(cfg Config, rt runtime, b *bus.Bus) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if rt == nil || b == nil {
		return nil, fmt.Errorf("detector needs a runtime and a bus")
	}
	return &Service{cfg: cfg, rt: rt, bus: b, wake: make(chan struct{}, 1), mu: make(chan struct{}, 1),
		retry: make(chan struct{}, 1), ready: make(chan struct{})}, nil
}

// Ready is closed once the detector can answer a detect command with the node's records: the detect command,
// the records query and the node's image.removed and pull.pulled events are subscribed at the server, and a
// first detection has succeeded, so the records bucket holds the node's images. While the runtime or the
// bucket fails, Run tries the detection again (retryWait) and Ready stays open.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// lock takes the detection lock, or fails when ctx ends first.
func (s *Service) lock(ctx context.Context) error {
	select {
	case s.mu <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait for the running detection: %w", ctx.Err())
	}
}

func (s *Service) unlock() { <-s.mu }

// Deadlines of the NATS calls made under the detection lock. Without them a call could wait forever, and
// every detection and detect command after it with it: an asynchronous publish (the records batch, the
// events) whose ack never comes (it went to a stream leader that was lost, CI's fleet test killing nats-1)
// is never failed by nats.go while the connection stays up, and the worker's context has no deadline.
const (
	// attemptTimeout bounds one attempt; a batch of n records or events gets a millisecond more per item
	// (10,000 records write in well under that even on a loaded machine).
	attemptTimeout = bus.AttemptTimeout
	// retryFor bounds the attempts of one records call: a cluster that lost a server elects new stream
	// leaders within seconds; past this the detection fails and the next one tries again. (An events
	// publish gets one attempt under the lock; Run retries it: see retryWait.)
	retryFor = 30 * time.Second
	// maxCallWait is the longest wait between two attempts of a records call (past bus.ElectionWindow).
	maxCallWait = 2 * time.Second
	// detectTimeout bounds a detect command (the CLI waits 30 s by default): a reply after it is not read.
	detectTimeout = 30 * time.Second
)

// call runs op (a records write: safe to repeat) with bus.Retry: a deadline per attempt, again after a
// transient failure (a timeout, no responders, no leader yet) until retryFor has passed, on bus.RetryWait's
// schedule (capped at maxCallWait): every 200-300 ms while the bucket may be electing a new leader, so the
// write, and the detect command waiting for it, goes through within a fraction of a second of the election.
func call(ctx context.Context, n int, op func(context.Context) error) error {
	return bus.Retry(ctx, op, bus.PerAttempt(attemptTimeout+time.Duration(n)*time.Millisecond),
		bus.MaxElapsed(retryFor), bus.MaxWait(maxCallWait))
}

// load reads the store into memory unless it is there; the caller holds the lock.
func (s *Service) load(ctx context.Context) error {
	if s.loaded {
		return nil
	}
	recs, err := s.loadStore(ctx)
	if err != nil {
		return err
	}
	s.records, s.loaded = records.NewTable(recs), true
	s.settle(recs)
	return nil
}

// settle queues the events of in-doubt changes the store shows were written: an added record it holds as
// detected (same first detection), a removed record it no longer holds. The others were not written, and the
// detection that follows finds them again. The caller holds the lock.
func (s *Service) settle(stored map[string]events.ImageRecord) {
	if len(s.inDoubt.Added)+len(s.inDoubt.Removed) == 0 {
		return
	}
	var landed records.Changes
	for _, r := range s.inDoubt.Added {
		if got, ok := stored[r.ID]; ok && got.FirstDetected.Equal(r.FirstDetected) {
			landed.Added = append(landed.Added, r)
		}
	}
	for _, r := range s.inDoubt.Removed {
		if _, ok := stored[r.ID]; !ok {
			landed.Removed = append(landed.Removed, r)
		}
	}
	s.inDoubt = records.Changes{}
	if len(landed.Added)+len(landed.Removed) == 0 {
		return
	}
	if err := s.queue(landed); err != nil {
		s.cfg.Logger.Warn("image events of a records write in doubt not queued", "node", s.cfg.Node, "err", err)
		return
	}
	s.cfg.Logger.Info("records write in doubt had landed; publishing its events", "node", s.cfg.Node,
		"detected", len(landed.Added), "vanished", len(landed.Removed))
	// Published by this detection's flush (unless earlier events wait for Run's retry: then with them), or by
	// Run's retry if the detection fails before it.
	s.askRetry()
}

// askRetry tells Run that events wait for its retry (one slot: a signal already waiting is enough).
func (s *Service) askRetry() {
	select {
	case s.retry <- struct{}{}:
	default:
	}
}

// loadStore reads the node's records within retryFor: one attempt, as the bucket's listing retries a
// transient failure itself and a long listing (10,000 records on a loaded machine) needs the time.
func (s *Service) loadStore(ctx context.Context) (map[string]events.ImageRecord, error) {
	ctx, cancel := context.WithTimeout(ctx, retryFor)
	defer cancel()
	return s.store.Load(ctx)
}

// write stores the changes; on failure memory is ahead of the store, so the next detection reloads it.
// The caller holds the lock.
func (s *Service) write(ctx context.Context, puts []events.ImageRecord, deletes []string) error {
	write := s.store.Write
	if s.storeWrite != nil {
		write = s.storeWrite
	}
	if err := call(ctx, len(puts)+len(deletes), func(ctx context.Context) error { return write(ctx, puts, deletes) }); err != nil {
		s.loaded = false
		return err
	}
	return nil
}

// Run detects at start, every Period, and on each detect command; it answers record queries. Between
// periods it follows the node's events: an image.removed event deletes the removed image's record (the
// kubelet's freeImage deletes it with the image), a pull.pulled event runs a detection at once, so records
// reflect a pull or a removal within a second; the Period stays as the floor. Image events whose publish
// failed are published again on their own schedule (retryWait: 1 s doubling to 30 s, jittered), not at the
// next detection, and a failed detection is tried again on the same schedule, not a period later. It
// blocks until ctx ends and returns nil after a clean shutdown.
func (s *Service) Run(ctx context.Context) error {
	if err := s.Open(ctx); err != nil {
		return err
	}
	log := s.cfg.Logger.With("worker", "detector", "node", s.cfg.Node)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	// Every subscription is made here, before Ready: made in the goroutines that use them, one could reach
	// the server after Ready, and a command sent at once found no responders.
	var listeners []*bus.Listener
	var subs []*bus.Subscription
	closeAll := func() {
		for _, l := range listeners {
			l.Close()
		}
		for _, sub := range subs {
			sub.Close()
		}
	}
	for _, q := range []struct {
		subject string
		h       bus.Handler
	}{
		{events.CommandSubject(s.cfg.Node, events.VerbDetect), s.handleDetect},
		{events.QuerySubject(s.cfg.Node, events.QryRecords), s.handleRecords},
	} {
		l, err := s.bus.Listen(ctx, q.subject, events.DetectorQueue, 1, q.h)
		if err != nil {
			closeAll()
			return err
		}
		listeners = append(listeners, l)
	}
	for _, subject := range []string{
		events.EventSubject(s.cfg.Node, events.EntityImage, events.ActionRemoved),
		events.EventSubject(s.cfg.Node, events.EntityPull, events.ActionPulled),
	} {
		sub, err := s.bus.SubscribeSync(ctx, subject)
		if err != nil {
			closeAll()
			return err
		}
		subs = append(subs, sub)
	}
	for _, l := range listeners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer l.Close()
			if err := l.Serve(ctx); err != nil {
				errs <- err
			}
		}()
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		defer subs[0].Close()
		subs[0].Each(ctx, func(err error) {
			// Removals dropped by a reader that fell behind (a pass that removed thousands of images at
			// once): their records are forgotten at the next detection, which reports them vanished.
			log.Warn("image removals not read; the next detection reports them vanished", "err", err)
		}, func(_ string, header map[string][]string, data []byte) { s.onRemoved(header, data) })
	}()
	go func() {
		defer wg.Done()
		defer subs[1].Close()
		subs[1].Notify(ctx, s.onPulled)
	}()

	tick := time.NewTicker(s.cfg.Period)
	defer tick.Stop()
	// The retry of unpublished events: armed when a publish fails (s.retry), one attempt each time it fires,
	// armed again while events wait; its failures count the attempts since the backlog was last empty.
	var republishing retrySchedule
	defer republishing.stop()
	// A failed detection (the runtime or the records bucket did not answer) is tried again on the same
	// schedule, not a period later: the kubelet's detection feeds only its own cache, ours the node's records
	// and the fleet's event feed, which would miss the node's images for a whole period.
	var redetecting retrySchedule
	defer redetecting.stop()
	for first := true; ; first = false {
		if !first {
			select {
			case <-ctx.Done():
				wg.Wait()
				return nil
			case err := <-errs:
				cancel()
				wg.Wait()
				return err
			case <-tick.C:
			case <-redetecting.c:
			case <-s.wake:
				s.onEvents(ctx, log)
				continue
			case <-s.retry:
				if republishing.c == nil {
					republishing.arm()
				}
				continue
			case <-republishing.c:
				republishing.c = nil
				republishing.failures++
				if s.republish(ctx, log, republishing.failures) {
					republishing.arm()
				} else {
					republishing.failures = 0
				}
				continue
			}
		}
		redetecting.stop()
		_, err := s.Detect(ctx, s.cfg.Now())
		switch {
		case ctx.Err() != nil:
		case err != nil:
			// The kubelet logs "Failed to monitor images" and tries again next period; we try sooner.
			wait := redetecting.arm()
			redetecting.failures++
			log.Warn("failed to monitor images", "err", err, "retry_in", wait.Round(time.Millisecond))
		default:
			redetecting.failures = 0
			s.readyOnce.Do(func() { close(s.ready) })
		}
	}
}

// onRemoved queues the record of an image GC removed for deletion.
func (s *Service) onRemoved(header map[string][]string, data []byte) {
	ev, err := events.DecodeEventMsg(header, data)
	if err != nil {
		return
	}
	var r events.ImageRemoved
	if err := ev.DecodeData(&r); err != nil || r.ID == "" {
		return
	}
	s.evMu.Lock()
	s.removedIDs = append(s.removedIDs, r.ID)
	s.evMu.Unlock()
	s.poke()
}

// onPulled asks for a detection at once.
func (s *Service) onPulled() {
	s.evMu.Lock()
	s.pulled = true
	s.evMu.Unlock()
	s.poke()
}

func (s *Service) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// onEvents applies what the events asked for since the last wake: forget removed images, detect after pulls.
func (s *Service) onEvents(ctx context.Context, log interface{ Warn(string, ...any) }) {
	s.evMu.Lock()
	ids, pulled := s.removedIDs, s.pulled
	s.removedIDs, s.pulled = nil, false
	s.evMu.Unlock()
	if len(ids) > 0 {
		if err := s.Forget(ctx, ids); err != nil && ctx.Err() == nil {
			log.Warn("failed to delete the records of removed images", "err", err)
		}
	}
	if pulled {
		if _, err := s.Detect(ctx, s.cfg.Now()); err != nil && ctx.Err() == nil {
			log.Warn("failed to monitor images", "err", err)
		}
	}
}

// Forget deletes the records of images GC removed, as the kubelet's freeImage does. No image.vanished event
// is published for them: image.removed already said they are gone.
func (s *Service) Forget(ctx context.Context, ids []string) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.unlock()
	if err := s.load(ctx); err != nil {
		return err
	}
	gone := s.records.Forget(ids)
	if len(gone) == 0 {
		return nil
	}
	return s.write(ctx, nil, gone)
}

// Open opens the records store; Run calls it. Tests and benchmarks that call Detect directly call it first.
func (s *Service) Open(ctx context.Context) error {
	store, err := records.OpenStore(ctx, s.bus, s.cfg.Node)
	if err != nil {
		return err
	}
	s.store = store
	return nil
}

// Detect runs one detection with detectTime for new records, writes the changes to the store, publishes
// image.detected and image.vanished events (those NATS does not take now wait for Run's retry, counted in
// the reply's Unpublished; while events wait for it, the detection's own wait with them), and returns a
// summary.
func (s *Service) Detect(ctx context.Context, detectTime time.Time) (events.DetectReply, error) {
	return s.detect(ctx, detectTime, false)
}

// detect is Detect; withRecords also returns the node's records (the in-memory table, equal to the store
// once the write succeeded) in the reply's List when they fit in events.MaxDetectReplyListBytes.
func (s *Service) detect(ctx context.Context, detectTime time.Time, withRecords bool) (events.DetectReply, error) {
	start := time.Now()
	if err := s.lock(ctx); err != nil {
		return events.DetectReply{}, err
	}
	defer s.unlock()
	// Events of an earlier detection wait for Run's retry: NATS did not take them, and would most likely
	// not take this detection's either.
	retrying := len(s.unpublished) > 0
	if err := s.load(ctx); err != nil {
		return events.DetectReply{}, err
	}
	// The kubelet lists images then containers one after the other; both calls are reads, so they run at
	// once here (a detection costs about the slower of the two instead of their sum).
	var (
		containers []cri.Container
		cErr       error
		listed     = make(chan struct{})
	)
	go func() {
		defer close(listed)
		containers, cErr = s.rt.ListContainers(ctx)
	}()
	images, err := s.rt.ListImages(ctx)
	<-listed
	if err != nil {
		return events.DetectReply{}, fmt.Errorf("detect images: %w", err)
	}
	if cErr != nil {
		return events.DetectReply{}, fmt.Errorf("detect images: %w", cErr)
	}
	ch := s.records.Detect(images, containers, detectTime, s.cfg.Now())
	puts := append(append([]events.ImageRecord(nil), ch.Added...), ch.Updated...)
	removed := make([]string, 0, len(ch.Removed))
	for _, r := range ch.Removed {
		removed = append(removed, r.ID)
	}
	if err := s.write(ctx, puts, removed); err != nil {
		s.inDoubt.Added = append(s.inDoubt.Added, ch.Added...)
		s.inDoubt.Removed = append(s.inDoubt.Removed, ch.Removed...)
		return events.DetectReply{}, err
	}
	if err := s.queue(ch); err != nil {
		return events.DetectReply{}, err
	}
	// The records are written: the detection has succeeded whether or not NATS takes its events now (a GC
	// pass waiting for this reply needs the records, not the events). Events it does not take wait for Run's
	// retry, and the reply says how many. While earlier events wait for that retry, this detection's join
	// them without an attempt of its own: each attempt would hold this reply, and every detection after it,
	// for as long as a failing publish takes (half a second of no-responders retries while the events stream
	// elects a leader, attemptTimeout for an ack lost with the old one), and the detect commands that queued
	// up meanwhile (an operator's or a GC pass's retries) would each add it again: a fresh command
	// answered seconds after the records bucket had its leader back.
	if !retrying {
		if err := s.flush(ctx); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("image events not published; retrying", "node", s.cfg.Node, "events", len(s.unpublished), "err", err)
		}
	}
	rep := events.DetectReply{Node: s.cfg.Node, Time: detectTime, Records: s.records.Len(), InUse: len(ch.InUse),
		Added: len(ch.Added), Removed: len(ch.Removed), Unpublished: len(s.unpublished)}
	if withRecords {
		rep.List, rep.Listed = listIfFits(s.records.Map())
	}
	rep.Duration = events.Duration{Duration: time.Since(start)}
	return rep, nil
}

// listIfFits returns recs sorted by ID when their JSON fits in events.MaxDetectReplyListBytes.
func listIfFits(recs map[string]events.ImageRecord) ([]events.ImageRecord, bool) {
	list := make([]events.ImageRecord, 0, len(recs))
	for _, r := range recs {
		list = append(list, r)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
	if raw, err := json.Marshal(list); err != nil || len(raw) > events.MaxDetectReplyListBytes {
		return nil, false
	}
	return list, true
}

// maxUnpublished bounds the events kept for a later publish while NATS does not take them.
const maxUnpublished = 10000

// Retry of unpublished events (Run): the wait before the n-th attempt (n from 1) is drawn from the upper
// half of min(retryInitial * 2^(n-1), retryMax), so the nodes of a cluster that refused them all at once do
// not come back at once either.
const (
	retryInitial = time.Second
	retryMax     = 30 * time.Second
)

// retrySchedule is a retry armed on retryWait's schedule: c fires once, failures after the last arm.
type retrySchedule struct {
	timer    *time.Timer
	c        <-chan time.Time // nil: not armed
	failures int              // failed attempts since the last success
}

// arm starts the wait for the retry after failures failed ones and returns it.
func (r *retrySchedule) arm() time.Duration {
	wait := retryWait(r.failures)
	r.timer = time.NewTimer(wait)
	r.c = r.timer.C
	return wait
}

// stop disarms the retry.
func (r *retrySchedule) stop() {
	if r.timer != nil {
		r.timer.Stop()
	}
	r.timer, r.c = nil, nil
}

// retryWait is the wait before the retry after n failed retries: 0.5-1 s, 1-2 s, 2-4 s, 4-8 s, 8-16 s, then
// 15-30 s.
func retryWait(n int) time.Duration {
	d := retryMax
	if n < 5 {
		d = min(retryInitial<<n, retryMax)
	}
	return d/2 + rand.N(d/2)
}

// queue appends the changes' image.detected and image.vanished events to those of earlier detections that
// are not published yet (the records already say what changed, so no later detection would publish them
// again). The caller holds the lock.
func (s *Service) queue(ch records.Changes) error {
	for _, r := range ch.Added {
		ev, err := events.New(s.cfg.Node, events.EntityImage, events.ActionDetected, r)
		if err != nil {
			return err
		}
		s.unpublished = append(s.unpublished, ev)
	}
	for _, r := range ch.Removed {
		ev, err := events.New(s.cfg.Node, events.EntityImage, events.ActionVanished, r)
		if err != nil {
			return err
		}
		s.unpublished = append(s.unpublished, ev)
	}
	return nil
}

// flush makes one attempt (attemptTimeout, plus a millisecond per event) to publish the queued events,
// oldest first. On failure they stay queued, the oldest dropped past maxUnpublished, and Run is told to
// retry them. A retry publishes an event again with its id, which the stream stores once (within its
// 2-minute duplicate window). The caller holds the lock: publishes of the queue never overlap, so its order
// is kept.
func (s *Service) flush(ctx context.Context) error {
	if len(s.unpublished) == 0 {
		return nil
	}
	evs := s.unpublished
	actx, cancel := context.WithTimeout(ctx, attemptTimeout+time.Duration(len(evs))*time.Millisecond)
	err := s.bus.PublishAll(actx, evs)
	cancel()
	if err == nil {
		s.unpublished = nil
		return nil
	}
	if n := len(s.unpublished) - maxUnpublished; n > 0 {
		s.cfg.Logger.Warn("image events dropped: NATS has not taken them", "node", s.cfg.Node, "dropped", n)
		s.unpublished = slices.Clone(s.unpublished[n:])
	}
	s.askRetry()
	return err
}

// republish is the n-th retry of the queued events (Run's timer): one attempt under the lock, after any
// detection running now (which publishes them first itself). It reports whether events still wait.
func (s *Service) republish(ctx context.Context, log interface {
	Info(string, ...any)
	Debug(string, ...any)
}, n int) bool {
	if err := s.lock(ctx); err != nil {
		return false // shutting down
	}
	defer s.unlock()
	queued := len(s.unpublished)
	if queued == 0 {
		return false
	}
	if err := s.flush(ctx); err != nil {
		if ctx.Err() == nil {
			log.Debug("retry of image events failed", "events", len(s.unpublished), "retry", n, "err", err)
		}
		return ctx.Err() == nil
	}
	log.Info("image events published on retry", "events", queued, "retry", n)
	return false
}

func (s *Service) handleDetect(ctx context.Context, data []byte) (any, error) {
	var req events.DetectRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	t := s.cfg.Now()
	if req.Time != nil {
		t = *req.Time
	}
	ctx, cancel := context.WithTimeout(ctx, detectTimeout)
	defer cancel()
	return s.detect(ctx, t, req.WithRecords)
}

func (s *Service) handleRecords(ctx context.Context, data []byte) (any, error) {
	var q events.QueryRequest
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	recs, err := s.loadStore(ctx)
	if err != nil {
		return nil, err
	}
	return events.RecordsReply{Node: s.cfg.Node, Records: SortRecords(recs, q.Limit)}, nil
}

// SortRecords lists records by size descending then ID (the order `imagefleet records` prints), capped at limit.
func SortRecords(recs map[string]events.ImageRecord, limit int) []events.ImageRecord {
	out := make([]events.ImageRecord, 0, len(recs))
	for _, r := range recs {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Size != out[j].Size {
			return out[i].Size > out[j].Size
		}
		return out[i].ID < out[j].ID
	})
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out
}
