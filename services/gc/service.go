package gc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Deps are the GC executor's dependencies.
type Deps struct {
	// Runtime is the CRI client (ListContainers, RemoveImage, ImageFsInfo). Required.
	Runtime runtime
	// Bus is the NATS connection. Required.
	Bus *bus.Bus
	// Records detects and returns the node's image records (default: the detector over Bus).
	Records recordSource
	// Statfs returns capacity and available bytes of a filesystem (default cri.Statfs).
	Statfs func(path string) (capacity, available int64, err error)
	// Now is the clock of freeTime and beganGC (default time.Now).
	Now func() time.Time
}

// Service is the GC executor of one node.
type Service struct {
	cfg Config
	c   *collector
	bus *bus.Bus
	log *slog.Logger

	// mu makes passes one at a time (the kubelet's GC manager is serialised the same way) and guards beganGC.
	mu      sync.Mutex
	beganGC time.Time

	// prevFailed is the periodic loop's "previous pass failed" (only the loop goroutine touches it).
	prevFailed bool
	// running is set while a pass runs: the usage check does not queue a pass behind another.
	running atomic.Bool
	// checkNow asks the loop for a usage check at once (a pull finished on the node).
	checkNow chan struct{}
	metrics  *metrics
	// quietUntil: after a usage-triggered pass that failed (nothing more to remove), the timed checks wait
	// one Period before trying again, so FreeDiskSpaceFailed is posted no more often than the kubelet posts
	// it; a pull still triggers a check at once. Only the loop goroutine touches it.
	quietUntil time.Time

	// recent answers repeats of a GC request id (handleGC).
	recent recentRequests

	// lease serialises passes across the node's executor replicas (lease.go); leaseMetrics counts its outcomes.
	lease        *leaser
	leaseMetrics *leaseMetrics

	// policy is the node's delivered ImageGCPolicy in force (policy.go); policyUpdates counts deliveries.
	policy        policyState
	policyUpdates *prometheus.CounterVec

	ready     chan struct{}
	readyOnce sync.Once
}

// New validates cfg (see Config.Validate for the messages) and builds the executor.
func New(cfg Config, deps Deps) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if deps.Runtime == nil || deps.Bus == nil {
		return nil, errors.New("gc executor needs a runtime and a bus")
	}
	if deps.Records == nil {
		deps.Records = &busRecords{bus: deps.Bus, node: cfg.Node, timeout: cfg.DetectTimeout}
	}
	if deps.Statfs == nil {
		deps.Statfs = cri.Statfs
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	counter, err := newRemovedCounter(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register image gc metric: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register image gc metrics: %w", err)
	}
	lm, err := newLeaseMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register image gc lease metrics: %w", err)
	}
	pu, err := newPolicyUpdates(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register image gc policy metrics: %w", err)
	}
	pinned, _ := newRefMatcher(cfg.PinnedImages, true) // validated above
	log := cfg.Logger.With("worker", events.GCQueue, "node", cfg.Node)
	s := &Service{cfg: cfg, bus: deps.Bus, log: log, beganGC: deps.Now(), checkNow: make(chan struct{}, 1), metrics: m,
		lease: newLeaser(deps.Bus, cfg.Node, cfg.LeaseTTL, log), leaseMetrics: lm, policyUpdates: pu, ready: make(chan struct{})}
	s.c = &collector{
		node: cfg.Node, capacity: cfg.CapacityBytes, pinned: pinned, parallelism: cfg.RemovalParallelism,
		rt: deps.Runtime, records: deps.Records, bus: deps.Bus, inUseTimeout: cfg.InUseTimeout,
		statfs: deps.Statfs, now: deps.Now, removed: counter, metrics: m, log: log,
	}
	if sb, ok := deps.Runtime.(interface {
		SandboxImage(ctx context.Context) (string, error)
	}); ok {
		s.c.sandboxImage = (&sandboxCache{read: sb.SandboxImage, now: time.Now}).get
	}
	return s, nil
}

// Ready is closed once the gc command and (unless the policy disables the loop) the node's pull.pulled
// events are subscribed at the server: a command sent after it is answered, a pull finished after it is
// checked.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run serves imagefleet.cmd.<node>.gc (queue group gc-executor) and runs the periodic GC every Period,
// with beganGC captured once here as the kubelet's StartGarbageCollection does. Unlike the kubelet (whose
// first pass at start usually fails once, "Stats initialization may not have completed yet"), the first
// periodic pass runs one Period after start; a pass can be asked for at any time with the gc command.
//
// Between periods, the image filesystem is checked every CheckPeriod (statfs of the runtime's image
// filesystem, or the byte quota's sum of listed sizes) and at once when a pull finishes on the node (a
// pull.pulled event); a pass starts when usage is at or above the high threshold (trigger "usage"). A check
// while a pass runs is skipped: passes never overlap. When the policy has HighThresholdPercent 100 and MaxAge
// 0 the periodic GC and the check are disabled (commands are still served). The node's GC pass lease bucket
// is opened at start, beside the loop (leaser.warm). Run blocks until ctx ends and returns nil after a clean
// shutdown.
func (s *Service) Run(ctx context.Context) error {
	s.mu.Lock()
	s.beganGC = s.c.now()
	s.mu.Unlock()

	// Every subscription is made here, before Ready: made in the goroutines that use them, one could reach
	// the server after Ready, and a command sent at once found no responders.
	l, err := s.bus.Listen(ctx, events.CommandSubject(s.cfg.Node, events.VerbGC), events.GCQueue, 1, s.handleGC)
	if err != nil {
		return stopped(ctx, err)
	}
	var pulled *bus.Subscription
	if !s.cfg.Policy.disabled() {
		if pulled, err = s.bus.SubscribeSync(ctx, events.EventSubject(s.cfg.Node, events.EntityPull, events.ActionPulled)); err != nil {
			l.Close()
			return stopped(ctx, err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	serveErr := make(chan error, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		serveErr <- l.Serve(ctx)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.watchPolicy(ctx)
	}()
	if s.lease != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.lease.warm(ctx)
		}()
	}
	wait := func() error {
		select {
		case <-ctx.Done():
			return nil
		case err := <-serveErr:
			if err != nil {
				return err
			}
			<-ctx.Done()
			return nil
		}
	}
	if pulled == nil {
		s.log.Info("ImageGCHighThresholdPercent is set 100 and ImageMaximumGCAge is 0, Disable image GC")
		s.readyOnce.Do(func() { close(s.ready) })
		return wait()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer pulled.Close()
		pulled.Notify(ctx, s.CheckSoon)
	}()
	s.readyOnce.Do(func() { close(s.ready) })
	tick := time.NewTicker(s.cfg.Period)
	defer tick.Stop()
	check := time.NewTicker(s.cfg.CheckPeriod)
	defer check.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-serveErr:
			return err
		case <-tick.C:
			s.periodic(ctx)
		case <-check.C:
			s.checkUsage(ctx, true)
		case <-s.checkNow:
			s.checkUsage(ctx, false)
		}
	}
}

// CheckSoon asks the loop for a usage check at once (several asks before it runs make one check).
func (s *Service) CheckSoon() {
	select {
	case s.checkNow <- struct{}{}:
	default:
	}
}

// checkUsage measures the image filesystem and runs a pass when usage is at or above the high threshold. It
// is cheap (one ImageFsInfo and one statfs, or one ListImages with a byte quota) and skipped while a pass
// runs (a gc command).
func (s *Service) checkUsage(ctx context.Context, timed bool) {
	if s.running.Load() || (timed && time.Now().Before(s.quietUntil)) {
		return
	}
	st := s.settings()
	capacity, available, _, err := s.c.imageFs(ctx, s.c.quota(&pass{capacity: st.capacity}))
	if err != nil || capacity <= 0 {
		if ctx.Err() == nil {
			s.log.Debug("image fs usage check failed", "err", err, "capacity", capacity)
		}
		return
	}
	usage := 100 - int(min(available, capacity)*100/capacity)
	s.metrics.usage.Set(float64(usage))
	if usage < st.policy.HighThresholdPercent {
		return
	}
	s.log.Info("image fs usage reached the high threshold between periods, running image GC",
		"usage", usage, "high_threshold", st.policy.HighThresholdPercent)
	_, err = s.garbageCollect(ctx, events.GCRequest{}, events.GCTriggerUsage)
	if errors.Is(err, errLeaseHeld) {
		return // another replica's pass runs; the next check looks again
	}
	if err != nil && ctx.Err() == nil {
		s.log.Warn("image garbage collection on high usage failed", "err", err)
		s.quietUntil = time.Now().Add(s.cfg.Period)
		return
	}
	s.quietUntil = time.Time{}
}

// periodic is one tick of the kubelet's image GC loop: a failure is logged; a failure right after another
// one also posts the ImageGCFailed Warning with the error's text.
func (s *Service) periodic(ctx context.Context) {
	_, err := s.garbageCollect(ctx, events.GCRequest{}, events.GCTriggerPeriodic)
	if ctx.Err() != nil || errors.Is(err, errLeaseHeld) {
		return // another replica's pass runs: neither a success nor a failure of this loop
	}
	if err != nil {
		if s.prevFailed {
			s.log.Error("Image garbage collection failed multiple times in a row", "err", err)
			s.c.warn(ctx, nil, EventImageGCFailed, err.Error())
		} else {
			s.log.Error("Image garbage collection failed once. Stats initialization may not have completed yet", "err", err)
		}
		s.prevFailed = true
		return
	}
	if s.prevFailed {
		s.log.Info("Image garbage collection succeeded")
	} else {
		s.log.Debug("Image garbage collection succeeded")
	}
	s.prevFailed = false
}

// GarbageCollect runs one pass: the kubelet's GarbageCollect, or with req.AllUnused its DeleteUnusedImages,
// with req's policy overrides and dry run. It publishes gc.finished with the result and returns the result
// and the pass's error (also in the result's Error). An invalid override is an error wrapping
// events.ErrMalformed and runs nothing.
func (s *Service) GarbageCollect(ctx context.Context, req events.GCRequest) (events.GCResult, error) {
	trigger := req.Trigger
	if trigger == "" {
		trigger = events.GCTriggerManual
	}
	return s.garbageCollect(ctx, req, trigger)
}

func (s *Service) garbageCollect(ctx context.Context, req events.GCRequest, trigger string) (events.GCResult, error) {
	policy, err := s.settingsFor(req)
	if err != nil {
		return events.GCResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.running.Store(true)
	defer s.running.Store(false)
	if req.DryRun || s.lease == nil {
		return s.runPass(ctx, req, trigger, policy) // a dry run removes nothing: no lease
	}
	return s.leasedPass(ctx, req, trigger, policy)
}

// leasedPass takes the node's GC pass lease and runs the pass under it (see lease.go for what happens when
// another replica holds it). It returns errLeaseHeld, without running a pass, to a periodic or usage
// trigger that found the lease held.
func (s *Service) leasedPass(ctx context.Context, req events.GCRequest, trigger string, policy settings) (events.GCResult, error) {
	waits := trigger == events.GCTriggerManual || trigger == events.GCTriggerPull
	var began time.Time
	outcome := leaseAcquired
	for {
		v := leaseValue{Pass: randomID(8), Holder: s.lease.holder, Trigger: trigger, AllUnused: req.AllUnused,
			Overrides: hasOverrides(req), Started: time.Now().UTC()}
		rev, held, err := s.lease.acquire(ctx, v)
		if err != nil {
			if ctx.Err() != nil {
				return events.GCResult{}, ctx.Err()
			}
			s.log.Warn("image GC pass lease unavailable, running the pass without it (passes of this node's other executor replicas may overlap it)", "err", err)
			s.leaseMetrics.total.WithLabelValues(trigger, leaseUnavailable).Inc()
			return s.runPass(ctx, req, trigger, policy)
		}
		if held == nil {
			s.leaseMetrics.total.WithLabelValues(trigger, outcome).Inc()
			return s.passUnderLease(ctx, req, trigger, policy, rev, v)
		}
		if !waits {
			s.log.Info("image GC pass skipped: another executor replica's pass runs on the node",
				"trigger", trigger, "holder", held.Holder, "holder_trigger", held.Trigger, "since", held.Started)
			s.leaseMetrics.total.WithLabelValues(trigger, leaseSkipped).Inc()
			return events.GCResult{}, errLeaseHeld
		}
		if began.IsZero() {
			began = time.Now()
			s.log.Info("image GC request waits for another executor replica's pass",
				"trigger", trigger, "holder", held.Holder, "holder_trigger", held.Trigger, "since", held.Started)
			waiting := s.leaseMetrics.waiting.WithLabelValues(trigger)
			waiting.Inc()
			defer waiting.Dec()
		}
		done, err := s.lease.wait(ctx, *held, began.Add(s.cfg.LeaseWait), began)
		s.leaseMetrics.wait.WithLabelValues(trigger).Observe(time.Since(began).Seconds())
		if err != nil {
			if errors.As(err, new(*LeaseHeldError)) {
				s.leaseMetrics.total.WithLabelValues(trigger, leaseTimeout).Inc()
			}
			return events.GCResult{}, err
		}
		if done != nil && done.Result != nil && shareable(req, trigger, *done) {
			s.leaseMetrics.total.WithLabelValues(trigger, leaseShared).Inc()
			res := *done.Result
			if res.Error != "" {
				return res, errors.New(res.Error)
			}
			return res, nil
		}
		outcome = leaseWaited // the pass ended (or its holder died): take the lease
	}
}

// passUnderLease runs the pass while renewing the lease, and releases it with the result. A pass whose lease
// could not be renewed is stopped (its context cancelled) and fails with errLeaseLost.
func (s *Service) passUnderLease(ctx context.Context, req events.GCRequest, trigger string, policy settings, rev uint64, v leaseValue) (events.GCResult, error) {
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	kctx, stopKeep := context.WithCancel(ctx)
	kept := make(chan uint64, 1)
	go func() {
		kept <- s.lease.keep(kctx, rev, v, func() {
			s.leaseMetrics.total.WithLabelValues(trigger, leaseLost).Inc()
			cancel(errLeaseLost)
		})
	}()
	res, err := s.runPassCtx(pctx, ctx, req, trigger, policy)
	stopKeep()
	rev = <-kept
	if context.Cause(pctx) != errLeaseLost {
		s.lease.release(ctx, rev, v, res)
	}
	return res, err
}

// runPass runs one pass (without the lease) and publishes its result.
func (s *Service) runPass(ctx context.Context, req events.GCRequest, trigger string, policy settings) (events.GCResult, error) {
	return s.runPassCtx(ctx, ctx, req, trigger, policy)
}

// runPassCtx runs the pass under pctx (cancelled when the lease is lost) and publishes under ctx.
func (s *Service) runPassCtx(pctx, ctx context.Context, req events.GCRequest, trigger string, policy settings) (events.GCResult, error) {
	var err error
	p := &pass{policy: policy.policy, capacity: policy.capacity, pins: policy.pins, keepLast: policy.keepLast,
		keepCopies: policy.keepCopies, dryRun: req.DryRun,
		res: events.GCResult{Node: s.cfg.Node, DryRun: req.DryRun, Trigger: trigger, Policies: policy.sources}}
	start := time.Now()
	switch {
	case len(req.Images) > 0:
		err = s.c.deleteNamedImages(pctx, p, req.Images)
	case req.AllUnused:
		err = s.c.deleteUnusedImages(pctx, p)
	default:
		err = s.c.garbageCollect(pctx, p, s.beganGC)
	}
	if err != nil && context.Cause(pctx) == errLeaseLost && ctx.Err() == nil {
		err = fmt.Errorf("%w: %w", errLeaseLost, err)
	}
	res := p.res
	if res.Removed == nil {
		res.Removed = []events.GCRemoved{}
	}
	if res.Skipped == nil {
		res.Skipped = []events.GCSkipped{}
	}
	if res.Started.IsZero() {
		res.Started = s.c.now()
	}
	res.Duration = events.Duration{Duration: time.Since(start)}
	if err != nil {
		res.Error = err.Error()
	}
	for _, rm := range res.Removed {
		if rm.Error != "" {
			res.Failed = append(res.Failed, rm)
		}
	}
	if !req.DryRun {
		s.metrics.observe(req.AllUnused, trigger, res, err)
	}
	if ev, evErr := events.New(s.cfg.Node, events.EntityGC, events.ActionFinished, res); evErr == nil {
		s.c.publish(ctx, ev)
	}
	return res, err
}

// settingsFor applies req's overrides to the settings in force (the flags, with the node's ImageGCPolicy
// over them) and checks the result as the kubelet's NewImageGCManager does.
func (s *Service) settingsFor(req events.GCRequest) (settings, error) {
	st := s.settings()
	p := st.policy
	if req.HighThresholdPercent != nil {
		p.HighThresholdPercent = *req.HighThresholdPercent
	}
	if req.LowThresholdPercent != nil {
		p.LowThresholdPercent = *req.LowThresholdPercent
	}
	if req.MinAge != nil {
		p.MinAge = req.MinAge.Duration
	}
	if req.MaxAge != nil {
		p.MaxAge = req.MaxAge.Duration
	}
	if err := p.Validate(); err != nil {
		return settings{}, fmt.Errorf("%w: %w", events.ErrMalformed, err)
	}
	st.policy = p
	return st, nil
}

// stopped is nil when ctx ended (a shutdown while Run subscribed is a clean one), else err.
func stopped(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}
