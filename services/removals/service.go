package removals

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// ReasonImageRemovedExternally is the reason of the node Warning (not a kubelet reason: the kubelet has no
// such event; its own removals are what this often reports).
const ReasonImageRemovedExternally = "ImageRemovedExternally"

// Config configures the worker.
type Config struct {
	// Node is the node name (required).
	Node string
	// Grace is how long after an image vanished an imagefleet removal of it may still be published (the GC
	// executor publishes image.removed after its removal batch, and the detector may see the image gone
	// first). Default 30s.
	Grace time.Duration
	// Keep is how long an imagefleet removal is remembered (default 24h).
	Keep time.Duration
	// Logger (default slog.Default()); Registerer (default prometheus.DefaultRegisterer).
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Now is the clock (default time.Now).
	Now func() time.Time
	// OfflineWait is how long the worker waits for the server holding its consumer (of one replica, which
	// nats-server does not move off a server that is down) before it deletes the consumer and makes it anew
	// on a running server, from the vanished event after the last one it handled; a server back within it
	// keeps the consumer. Default 1m.
	OfflineWait time.Duration
}

// Service watches the node's image.removed and image.vanished events.
type Service struct {
	cfg     Config
	bus     *bus.Bus
	log     *slog.Logger
	counter prometheus.Counter

	mu      sync.Mutex
	removed map[string]time.Time // image ID -> when imagefleet removed it
	// removedSeq is the stream sequence of the last removal read: the next read of removals starts after it.
	removedSeq uint64

	// pos is how far the vanished events are handled: a consumer made anew (its server down) starts after it.
	pos position
	// startSeq is where the consumer is made to start (0: the stream's first message): the start of the
	// existing one, or after pos's floor when it is made anew.
	startSeq uint64

	// ready is closed once the consumer of the node's events is at the server (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

// position is how far the vanished events are handled. The floor is the stream sequence up to which every
// vanished event delivered is handled (or given up on, a dead letter): the last one handled, or just before
// the first one handed back for redelivery (a failed handling, a stop) and not handled since, which the
// consumer delivers again after later ones. It is known once the consumer's ack floor was read, the consumer
// was made, or an event handled.
type position struct {
	mu        sync.Mutex
	known     bool
	last      uint64          // the highest sequence handled or given up on
	redeliver map[uint64]bool // handed back, not handled since
}

// acked raises the floor to the consumer's ack floor (its start less one for a consumer just made): what
// the server counts acked is handled.
func (p *position) acked(floor uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.known = true
	p.last = max(p.last, floor)
	for seq := range p.redeliver {
		if seq <= floor {
			delete(p.redeliver, seq)
		}
	}
}

// done records the vanished event at seq handled (or given up on); handedBack records it handed back.
func (p *position) done(seq uint64, handedBack bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if handedBack {
		if p.redeliver == nil {
			p.redeliver = map[uint64]bool{}
		}
		p.redeliver[seq] = true
		return
	}
	delete(p.redeliver, seq)
	p.known = true
	p.last = max(p.last, seq)
}

// floor is the floor, and whether it is known.
func (p *position) floor() (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.last
	for seq := range p.redeliver {
		f = min(f, seq-1)
	}
	return f, p.known
}

// maxDeliver is how often a vanished event is delivered before it is given up on (a dead letter).
const maxDeliver = 5

// offlineRetry is how long after its first failure the worker asks again for its consumer while it is
// offline (or not reached); each wait after is twice the one before, up to maxOfflineRetry, jittered by
// ±20% so the nodes whose consumers one server held do not ask at once. A wait never ends past OfflineWait.
const (
	offlineRetry    = 5 * time.Second
	maxOfflineRetry = time.Minute
)

// New validates cfg and builds the worker.
func New(cfg Config, b *bus.Bus) (*Service, error) {
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, err
	}
	if cfg.Grace == 0 {
		cfg.Grace = 30 * time.Second
	}
	if cfg.Keep == 0 {
		cfg.Keep = 24 * time.Hour
	}
	if cfg.Grace < 0 || cfg.Keep < cfg.Grace {
		return nil, fmt.Errorf("removals: grace %v must not be negative nor longer than keep %v", cfg.Grace, cfg.Keep)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.DefaultRegisterer
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.OfflineWait <= 0 {
		cfg.OfflineWait = time.Minute
	}
	c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "imagefleet", Name: "images_removed_externally_total",
		Help: "Images that vanished from the node without an imagefleet removal (another remover at work: the kubelet's image GC or eviction manager, crictl rmi, ...)."})
	c, err := promreg.RegisterOrReuse(cfg.Registerer, c)
	if err != nil {
		return nil, fmt.Errorf("removals: register metrics: %w", err)
	}
	return &Service{cfg: cfg, bus: b, log: cfg.Logger.With("worker", "removals"), counter: c, removed: map[string]time.Time{},
		ready: make(chan struct{})}, nil
}

// Ready is closed once the past removals are read and the consumer of the node's vanished events exists with
// its first pull request at the server: an event published after it is handled. While the events stream is
// missing, Run retries (or fails) without closing it.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run remembers the node's imagefleet removals still in the stream, then consumes the node's image.vanished
// events with its durable consumer (events.RemovalsDurable, one replica) until ctx ends. When the server
// holding the consumer is down, it waits Config.OfflineWait for it, then makes the consumer anew after the
// last vanished event it handled.
func (s *Service) Run(ctx context.Context) error {
	if err := s.readRemovals(ctx, ""); err != nil && ctx.Err() == nil {
		return fmt.Errorf("removals: read past removals: %w", err)
	}
	if err := s.consumeVanished(ctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// consumeVanished consumes the node's image.vanished events until ctx ends, making its consumer anew when
// the server holding it stays down.
func (s *Service) consumeVanished(ctx context.Context) error {
	durable := events.RemovalsDurable(s.cfg.Node)
	var offlineSince time.Time
	unknownLogged := false
	retry := time.Duration(0)
	for {
		reached, err := s.consume(ctx)
		if ctx.Err() != nil || err == nil {
			return nil
		}
		if reached {
			// The consumer answered before this failure: a wait for its server starts now.
			offlineSince, unknownLogged, retry = time.Time{}, false, 0
		}
		retry = min(max(2*retry, offlineRetry), maxOfflineRetry)
		wait := retry*4/5 + rand.N(retry*2/5)
		switch {
		case bus.IsTransient(err):
			// The cluster electing leaders, a reconnection: the consumer is asked for again.
			s.log.Warn("removals consumer not reached; asking again", "durable", durable, "in", wait.Round(time.Millisecond), "err", err)
		case !bus.IsConsumerOffline(err):
			return fmt.Errorf("removals: %w", err)
		case offlineSince.IsZero():
			offlineSince, wait = time.Now(), min(wait, s.cfg.OfflineWait)
			s.log.Warn("removals consumer offline: the server holding it is down; waiting for it",
				"durable", durable, "wait", s.cfg.OfflineWait, "err", err)
		case time.Since(offlineSince) < s.cfg.OfflineWait:
			wait = min(wait, s.cfg.OfflineWait-time.Since(offlineSince))
		case !s.known():
			if !unknownLogged {
				unknownLogged = true
				s.log.Warn("removals consumer still offline and where it stood is unknown; waiting for its server",
					"durable", durable, "offline_for", time.Since(offlineSince).Round(time.Second))
			}
		default:
			floor, _ := s.pos.floor()
			from := floor + 1
			s.log.Warn("removals consumer still offline; deleting it and making it anew after the last vanished event handled",
				"durable", durable, "offline_for", time.Since(offlineSince).Round(time.Second), "from_seq", from)
			if derr := s.bus.DeleteConsumer(ctx, events.EventsStream, durable); derr != nil {
				s.log.Warn("delete of the offline removals consumer failed; waiting for its server", "durable", durable, "err", derr)
				break
			}
			s.startSeq, offlineSince, retry = from, time.Time{}, 0
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(max(wait, time.Millisecond)):
		}
	}
}

// consumerConfig is the worker's durable consumer: one replica (no Raft group of its own), the node's
// image.vanished events only.
func (s *Service) consumerConfig() bus.ConsumerConfig {
	return bus.ConsumerConfig{
		Stream: events.EventsStream, Durable: events.RemovalsDurable(s.cfg.Node),
		FilterSubjects: []string{s.subject(events.ActionVanished)}, Replicas: 1, StartSeq: s.startSeq,
		Concurrency: 1, MaxAckPending: 256, AckWait: 2*s.cfg.Grace + 30*time.Second, MaxDeliver: maxDeliver,
		Started: func() { s.readyOnce.Do(func() { close(s.ready) }) },
	}
}

// consume makes (or takes over, or updates) the consumer and consumes it until ctx ends or it fails;
// reached says whether the consumer's info was had (or it did not exist).
func (s *Service) consume(ctx context.Context) (reached bool, err error) {
	st, err := s.bus.Consumer(ctx, events.EventsStream, events.RemovalsDurable(s.cfg.Node))
	switch {
	case bus.IsConsumerNotFound(err):
		// Made now, at startSeq: what comes before it is not the consumer's to deliver.
		s.pos.acked(max(s.startSeq, 1) - 1)
	case err != nil:
		return false, err
	default:
		// It keeps the start it was made with; what it acked is handled.
		s.startSeq = st.StartSeq
		s.pos.acked(st.AckFloor)
		if s.previousRelease(st) {
			if err := s.takeOver(ctx, st); err != nil {
				return true, err
			}
		}
	}
	return true, s.bus.Consume(ctx, s.consumerConfig(), func(ctx context.Context, m *bus.Msg) error {
		err := s.Handle(ctx, m.Subject, m.Header, m.Data, m.StreamSeq, m.InProgress)
		// bus.Consume hands an event back on an error, unless it gives up on it (a dead letter).
		givenUp := err != nil && ctx.Err() == nil && (bus.IsPermanent(err) || m.NumDelivered >= maxDeliver)
		s.pos.done(m.StreamSeq, err != nil && !givenUp)
		return err
	})
}

// known reports whether the floor of the vanished events handled is known.
func (s *Service) known() bool {
	_, ok := s.pos.floor()
	return ok
}

func (s *Service) subject(action string) string {
	return events.EventSubject(s.cfg.Node, events.EntityImage, action)
}

// noteRemoved remembers the imagefleet removal at stream sequence seq (0: not known).
func (s *Service) noteRemoved(seq uint64, header map[string][]string, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq > s.removedSeq {
		s.removedSeq = seq
	}
	ev, err := events.DecodeEventMsg(header, data)
	if err != nil {
		return
	}
	var r events.ImageRemoved
	if ev.DecodeData(&r) != nil || r.ID == "" {
		return
	}
	s.removed[r.ID] = ev.Time
	if len(s.removed)%1024 == 0 {
		cut := s.cfg.Now().Add(-s.cfg.Keep)
		for id, t := range s.removed {
			if t.Before(cut) {
				delete(s.removed, id)
			}
		}
	}
}

// take forgets the imagefleet removal of id and reports whether there was one.
func (s *Service) take(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.removed[id]
	delete(s.removed, id)
	return ok
}

// readRemovals remembers the node's removals stored after the last one read, to the end of the stream (or,
// with id set, until the removal of id).
func (s *Service) readRemovals(ctx context.Context, id string) error {
	s.mu.Lock()
	from := s.removedSeq + 1
	s.mu.Unlock()
	err := s.bus.Read(ctx, events.EventsStream, s.subject(events.ActionRemoved), func(m bus.StreamMsg) error {
		s.noteRemoved(m.Seq, m.Header, m.Data)
		if id != "" && s.has(id) {
			return bus.StopReading
		}
		return nil
	}, bus.From(from))
	if err != nil {
		return fmt.Errorf("read removals from %d: %w", from, err)
	}
	return nil
}

// has reports whether an imagefleet removal of id is remembered.
func (s *Service) has(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.removed[id]
	return ok
}

// Handle handles one event of the node (seq is its stream sequence, named in errors): image.removed is
// remembered; image.vanished of an image imagefleet did not remove is reported. Anything else is acked
// untouched.
func (s *Service) Handle(ctx context.Context, subject string, header map[string][]string, data []byte, seq uint64, progress func() error) error {
	switch {
	case strings.HasSuffix(subject, "."+events.EntityImage+"."+events.ActionRemoved):
		s.noteRemoved(0, header, data)
		return nil
	case !strings.HasSuffix(subject, "."+events.EntityImage+"."+events.ActionVanished):
		return nil
	}
	ev, err := events.DecodeEventMsg(header, data)
	if err != nil {
		s.log.Warn("vanished event not decoded", "subject", subject, "err", err)
		return nil
	}
	var rec events.ImageRecord
	if err := ev.DecodeData(&rec); err != nil || rec.ID == "" {
		s.log.Warn("vanished event without an image record", "event_id", ev.ID, "err", err)
		return nil
	}
	if s.take(rec.ID) {
		return nil
	}
	// The GC executor may publish its removal just after the detector saw the image gone: read the removals
	// stored since the last read (every one of them remembered, so the rest of a GC batch needs no read)
	// until the grace has passed. The grace counts from the event's time, but never ends later than a grace
	// from now: an event time far ahead (a skewed or malformed clock) would hold the node's events behind it.
	deadline := ev.Time.Add(s.cfg.Grace)
	if latest := s.cfg.Now().Add(s.cfg.Grace); deadline.After(latest) {
		deadline = latest
	}
	for {
		if err := s.readRemovals(ctx, rec.ID); err != nil {
			return fmt.Errorf("vanished event %d: %w", seq, err)
		}
		if s.take(rec.ID) {
			return nil
		}
		wait := deadline.Sub(s.cfg.Now())
		if wait <= 0 {
			break
		}
		if progress != nil {
			_ = progress()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(wait, time.Second)):
		}
	}
	s.counter.Inc()
	tags := strings.Join(rec.RepoTags, ",")
	s.log.Warn("image removed by another remover, not imagefleet", "image_id", rec.ID, "repo_tags", tags,
		"size", rec.Size, "in_use", rec.InUse)
	msg := fmt.Sprintf("Image %s (%s, %d bytes) was removed from the node by something other than imagefleet: another image remover is at work (the kubelet's image GC or eviction manager, crictl rmi, ...)",
		rec.ID, orNone(tags), rec.Size)
	out, err := events.New(s.cfg.Node, events.EntityNode, events.ActionWarning, events.NodeWarning{Reason: ReasonImageRemovedExternally, Message: msg})
	if err != nil {
		return bus.Permanent(err)
	}
	sum := sha256.Sum256([]byte("removed-externally\x00" + ev.ID))
	out.ID = hex.EncodeToString(sum[:16]) // a redelivered vanished event reports once (Nats-Msg-Id)
	out = out.WithKube(events.Warning, ReasonImageRemovedExternally, msg, &events.ObjectRef{Kind: "Node", Name: s.cfg.Node})
	if err := s.bus.Publish(ctx, out); err != nil {
		return fmt.Errorf("publish removed-externally warning: %w", err)
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "no tags"
	}
	return s
}
