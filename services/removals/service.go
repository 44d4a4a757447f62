package removals

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
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
}

// Service watches the node's image.removed and image.vanished events.
type Service struct {
	cfg     Config
	bus     *bus.Bus
	log     *slog.Logger
	counter prometheus.Counter
	removed map[string]time.Time // image ID -> when imagefleet removed it
	// ready is closed once the consumer of the node's events is at the server (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

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
	c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "imagefleet", Name: "images_removed_externally_total",
		Help: "Images that vanished from the node without an imagefleet removal (another remover at work: the kubelet's image GC or eviction manager, crictl rmi, ...)."})
	c, err := promreg.RegisterOrReuse(cfg.Registerer, c)
	if err != nil {
		return nil, fmt.Errorf("removals: register metrics: %w", err)
	}
	return &Service{cfg: cfg, bus: b, log: cfg.Logger.With("worker", "removals"), counter: c, removed: map[string]time.Time{},
		ready: make(chan struct{})}, nil
}

// Ready is closed once the past removals are read and the consumer of the node's image events exists with its
// first pull request at the server: an event published after it is handled. While the events stream is
// missing, Run retries (or fails) without closing it.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run remembers the node's imagefleet removals still in the stream, then follows its image events until ctx
// ends.
func (s *Service) Run(ctx context.Context) error {
	if err := s.bus.Read(ctx, events.EventsStream, s.subject(events.ActionRemoved), func(m bus.StreamMsg) error {
		s.noteRemoved(m.Header, m.Data)
		return nil
	}); err != nil && ctx.Err() == nil {
		return fmt.Errorf("removals: read past removals: %w", err)
	}
	err := s.bus.Consume(ctx, bus.ConsumerConfig{
		Stream: events.EventsStream, Durable: events.RemovalsDurable(s.cfg.Node),
		FilterSubjects: []string{events.NodeEvents(s.cfg.Node)},
		Concurrency:    1, MaxAckPending: 256, AckWait: 2*s.cfg.Grace + 30*time.Second,
		Started: func() { s.readyOnce.Do(func() { close(s.ready) }) },
	}, func(ctx context.Context, m *bus.Msg) error {
		return s.Handle(ctx, m.Subject, m.Header, m.Data, m.StreamSeq, m.InProgress)
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (s *Service) subject(action string) string {
	return events.EventSubject(s.cfg.Node, events.EntityImage, action)
}

func (s *Service) noteRemoved(header map[string][]string, data []byte) {
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

// Handle handles one event of the node (seq is its stream sequence): image.removed is remembered;
// image.vanished of an image imagefleet did not remove is reported. Anything else is acked untouched.
func (s *Service) Handle(ctx context.Context, subject string, header map[string][]string, data []byte, seq uint64, progress func() error) error {
	switch {
	case strings.HasSuffix(subject, "."+events.EntityImage+"."+events.ActionRemoved):
		s.noteRemoved(header, data)
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
	if _, ok := s.removed[rec.ID]; ok {
		delete(s.removed, rec.ID)
		return nil
	}
	// The GC executor may publish its removal just after the detector saw the image gone: look at what
	// follows in the stream until the grace has passed. The grace counts from the event's time, but never
	// ends later than a grace from now: an event time far ahead (a skewed or malformed clock) would hold the
	// node's events behind it.
	deadline := ev.Time.Add(s.cfg.Grace)
	if latest := s.cfg.Now().Add(s.cfg.Grace); deadline.After(latest) {
		deadline = latest
	}
	for {
		found := false
		err := s.bus.Read(ctx, events.EventsStream, s.subject(events.ActionRemoved), func(m bus.StreamMsg) error {
			s.noteRemoved(m.Header, m.Data)
			if _, found = s.removed[rec.ID]; found {
				return bus.StopReading
			}
			return nil
		}, bus.From(seq))
		if err != nil {
			return fmt.Errorf("read removals after %d: %w", seq, err)
		}
		if found {
			delete(s.removed, rec.ID)
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
