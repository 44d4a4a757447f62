package puller

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Service is the puller worker of one node: it consumes the node's pull requests from the work queue and
// answers each with events. Replicas of it share the queue; the server's MaxAckPending on the node's durable
// consumer bounds the pulls in flight across all of them.
//
// Locks: mu guards inflight and deleted; the manager has its own (flights). They are never held together.
// An anchor's mu is taken under the manager's (never the reverse); its wmu, around riders record writes,
// with no other lock.
type Service struct {
	cfg Config
	bus *bus.Bus
	m   *manager
	// riders keeps the requests riding on another request's message (riders.go); nil until Run opens
	// the bucket: a request then keeps its own token when it joins a pull.
	riders riderStore
	// rides counts the goroutines of requests whose message was acked or that ride on another's: Run
	// waits for them.
	rides sync.WaitGroup

	mu       sync.Mutex
	inflight map[string]*inflightReq // by request id
	deleted  map[string]time.Time    // pod UID -> when its deletion was heard
	// withdrawn are request ids cancelled before they started: dropped when the queue delivers them.
	withdrawn map[string]time.Time

	// ready is closed once Run's subscriptions and its consumer are at the server (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

type inflightReq struct {
	podUID string
	cancel context.CancelCauseFunc
}

// New validates cfg and builds the puller. Backoff and pull records are in memory until Run moves them to
// the bus's KV buckets; a handler called before Run (a test) works on the in-memory state.
func New(cfg Config, rt runtime, b *bus.Bus) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if rt == nil || b == nil {
		return nil, fmt.Errorf("puller needs a runtime and a bus")
	}
	s, err := newService(cfg, criImages{rt: rt}, b)
	if err != nil {
		return nil, err
	}
	if fsrt, ok := rt.(interface {
		ImageFsInfo(ctx context.Context) ([]cri.FsInfo, error)
	}); ok && cfg.ImageGCHighThresholdPercent > 0 {
		s.m.room = &room{node: cfg.Node, high: cfg.ImageGCHighThresholdPercent, margin: cfg.PullRoomMarginPercent,
			fs: imageFsFunc(fsrt), size: registrySize, gc: busGC(b, cfg.Node, 10*time.Minute), log: s.m.cfg.log}
	}
	return s, nil
}

func newService(cfg Config, svc imageService, b *bus.Bus) (*Service, error) {
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	creds := &fileCredentials{log: cfg.Logger}
	if cfg.PullSecretsDir != "" {
		creds.secrets = &secretsDir{dir: cfg.PullSecretsDir}
	}
	if cfg.NodeKeyring != "" {
		k, err := loadNodeKeyring(cfg.NodeKeyring)
		if err != nil {
			return nil, err
		}
		creds.node = k
	}
	mc := managerConfig{tokens: cfg.Tokens(), qps: cfg.RegistryPullQPS, burst: cfg.RegistryBurst,
		backoff: backoffPolicy{initial: cfg.BackoffInitial, max: cfg.BackoffMax}, verifyPolicy: cfg.CredentialVerificationPolicy,
		allowlist: cfg.PreloadedImagesAllowlist, now: cfg.Now, log: cfg.Logger.With("worker", "puller", "node", cfg.Node)}
	return &Service{cfg: cfg, bus: b, m: newManager(mc, svc, creds, newMemBackoff(), newMemRecords(), met),
		inflight: map[string]*inflightReq{}, deleted: map[string]time.Time{}, withdrawn: map[string]time.Time{},
		ready: make(chan struct{})}, nil
}

// Ready is closed once the pull cancellations and the node's pod events are subscribed at the server and the
// node's pull consumer exists with its first pull request at the server: a request queued after it is pulled,
// a cancellation sent after it is heard. The legacy queue's consumer (drainLegacy) is not waited for: most
// nodes have none. While the pull stream or the buckets are missing, Run retries (or fails) without closing
// it.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run consumes the node's pull requests and listens for cancellations and pod deletions until ctx ends.
// It returns nil after a clean shutdown: requests in progress are handed back to the queue (another
// replica, or the next start, takes them at once) and no goroutine is left.
func (s *Service) Run(ctx context.Context) error {
	bo, err := openKVBackoff(ctx, s.bus, s.cfg.Node, s.m.cfg.backoff)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	rs, err := openKVRecords(ctx, s.bus, s.cfg.Node)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	s.m.backoff, s.m.records.store, s.riders = bo, rs, rs

	// Every subscription is made here, flushed, before the consumer can close Ready: made in the goroutines
	// that read them, one could reach the server after Ready, and a cancellation sent at once was not heard.
	follows, err := s.subscribe(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}

	// The first worker to fail stops the others; an error after the stop is the stop's, not reported.
	g, ctx := errgroup.WithContext(ctx)
	goRun := func(f func() error) {
		g.Go(func() error {
			if err := f(); err != nil && ctx.Err() == nil {
				return err
			}
			return nil
		})
	}
	for _, f := range follows {
		goRun(func() error {
			defer f.sub.Close()
			s.follow(ctx, f.sub, f.fn)
			return nil
		})
	}
	handle := func(ctx context.Context, m *bus.Msg) error {
		return s.HandlePull(ctx, m.Data, Delivery{Count: m.NumDelivered, InProgress: m.InProgress})
	}
	cc := ConsumerConfig(s.cfg)
	cc.Started = func() { s.readyOnce.Do(func() { close(s.ready) }) }
	goRun(func() error { return s.bus.Consume(ctx, cc, handle) })
	goRun(func() error { return drainLegacy(ctx, s.bus, s.cfg, handle) }) // compat_single_queue.go
	goRun(func() error {
		t := time.NewTicker(time.Minute)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
				s.forgetDeleted(time.Now())
			}
		}
	})
	<-ctx.Done()
	err = g.Wait()
	// The consumers have returned, so no handler adds a ride any more; the rides end with ctx.
	s.rides.Wait()
	s.m.wait()
	return err
}

// following is a subscription of Run and what handles its messages.
type following struct {
	sub *bus.Subscription
	fn  func(ctx context.Context, subject string, header map[string][]string, data []byte)
}

// subscribe makes Run's subscriptions, each at the server when it returns: the pull cancellations, the
// node's pod deletions and, with PullOnPodAdd, its pod additions. On failure none is left.
func (s *Service) subscribe(ctx context.Context) ([]following, error) {
	want := []struct {
		subject string
		fn      func(ctx context.Context, subject string, header map[string][]string, data []byte)
	}{
		{events.CommandSubject(s.cfg.Node, events.VerbPullCancel), func(_ context.Context, _ string, _ map[string][]string, data []byte) {
			s.handleCancel(data)
		}},
		{events.EventSubject(s.cfg.Node, events.EntityPod, events.ActionDeleted), func(_ context.Context, subject string, header map[string][]string, data []byte) {
			s.handlePodDeleted(subject, header, data)
		}},
	}
	if s.cfg.PullOnPodAdd {
		want = append(want, struct {
			subject string
			fn      func(ctx context.Context, subject string, header map[string][]string, data []byte)
		}{events.EventSubject(s.cfg.Node, events.EntityPod, events.ActionAdded), s.handlePodAdded})
	}
	var out []following
	for _, w := range want {
		sub, err := s.bus.SubscribeSync(ctx, w.subject)
		if err != nil {
			for _, f := range out {
				f.sub.Close()
			}
			return nil, err
		}
		out = append(out, following{sub: sub, fn: w.fn})
	}
	return out, nil
}

// follow calls fn for each message of sub until ctx ends (bus.Subscription.Each), logging read errors.
func (s *Service) follow(ctx context.Context, sub *bus.Subscription, fn func(ctx context.Context, subject string, header map[string][]string, data []byte)) {
	sub.Each(ctx, func(err error) { s.m.cfg.log.Warn("subscription read failed", "err", err) },
		func(subject string, header map[string][]string, data []byte) { fn(ctx, subject, header, data) })
}

// handleCancel cancels the requests a PullCancel names. Every replica hears it; the one running the pull
// cancels it.
func (s *Service) handleCancel(data []byte) {
	var c events.PullCancel
	if err := events.DecodeStrict(data, &c); err != nil {
		s.m.cfg.log.Warn("malformed pull cancellation", "err", err)
		return
	}
	if c.PodUID != "" {
		s.cancelPod(c.PodUID, fmt.Errorf("pod %s: %w", c.PodUID, errPullCancelledOnRequest))
	}
	if c.RequestID != "" {
		s.mu.Lock()
		r := s.inflight[c.RequestID]
		if r == nil {
			s.withdrawn[c.RequestID] = time.Now()
		}
		s.mu.Unlock()
		if r != nil {
			r.cancel(fmt.Errorf("request %s: %w", c.RequestID, errPullCancelledOnRequest))
		}
	}
}

var (
	errPodDeleted             = errors.New("pod deleted")
	errPullCancelledOnRequest = errors.New("cancelled on request")
)

// handlePodDeleted cancels the deleted pod's pulls and remembers its UID, so requests still queued for it
// are dropped (kubernetes/kubernetes#88662). The message is decoded by the pod event contract's decoder.
func (s *Service) handlePodDeleted(subject string, header map[string][]string, data []byte) {
	ev, err := events.DecodePodEvent(subject, header, data)
	if err != nil {
		s.m.cfg.log.Warn("pod deleted event refused", "err", err)
		return
	}
	uid := string(ev.Pod.UID)
	s.mu.Lock()
	s.deleted[uid] = time.Now()
	s.mu.Unlock()
	s.cancelPod(uid, fmt.Errorf("pod %s: %w", uid, errPodDeleted))
}

func (s *Service) cancelPod(uid string, cause error) {
	s.mu.Lock()
	var cancels []context.CancelCauseFunc
	for _, r := range s.inflight {
		if r.podUID == uid {
			cancels = append(cancels, r.cancel)
		}
	}
	s.mu.Unlock()
	for _, c := range cancels {
		c(cause)
	}
}

func (s *Service) forgetDeleted(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid, t := range s.deleted {
		if now.Sub(t) > s.cfg.DeletedPodMemory {
			delete(s.deleted, uid)
		}
	}
	for id, t := range s.withdrawn {
		if now.Sub(t) > s.cfg.DeletedPodMemory {
			delete(s.withdrawn, id)
		}
	}
}

// dropReason says why a request must not run: its pod was deleted or it was withdrawn ("" to run it).
func (s *Service) dropReason(req events.PullRequest, pod events.PodRef) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.withdrawn[req.ID]; ok {
		delete(s.withdrawn, req.ID)
		return fmt.Sprintf("request %s: %v", req.ID, errPullCancelledOnRequest)
	}
	if pod.UID != "" {
		if _, ok := s.deleted[pod.UID]; ok {
			return fmt.Sprintf("pod %s: %v", pod.UID, errPodDeleted)
		}
	}
	return ""
}

// InFlight is the number of requests this replica is handling (for tests and status).
func (s *Service) InFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.inflight)
}

// EnsureBuckets creates the puller's buckets (backoff, pulled records) with cfg's settings, defaults for
// zero fields: what `imagefleet bus init` runs with the admin identity, so agents with node identities,
// which may not create buckets, find them.
func EnsureBuckets(ctx context.Context, b *bus.Bus, cfg Config) error {
	if cfg.BackoffInitial == 0 {
		cfg.BackoffInitial = 10 * time.Second
	}
	if cfg.BackoffMax == 0 {
		cfg.BackoffMax = 300 * time.Second
	}
	if _, err := openKVBackoff(ctx, b, cfg.Node, backoffPolicy{initial: cfg.BackoffInitial, max: cfg.BackoffMax}); err != nil {
		return err
	}
	_, err := openKVRecords(ctx, b, cfg.Node)
	return err
}
