package cache

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// NodeStatusMaxImages is the kubelet's default cap on images in node status (nodeStatusMaxImages).
const NodeStatusMaxImages = 50

// Config configures the cache.
type Config struct {
	// Node is the node name (required).
	Node string
	// Period between refreshes (default 30s, the kubelet's image cache period).
	Period time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// runtime is the part of the CRI client the cache needs.
type runtime interface {
	ListImages(ctx context.Context) ([]cri.Image, error)
}

// Service is the image-list cache of one node. Each replica refreshes its own copy; queries go to any.
type Service struct {
	cfg Config
	rt  runtime
	bus *bus.Bus

	mu        sync.RWMutex
	images    []events.Image
	refreshed time.Time

	ready     chan struct{}
	readyOnce sync.Once
}

// New validates cfg and builds the cache.
func New(cfg Config, rt runtime, b *bus.Bus) (*Service, error) {
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, err
	}
	if cfg.Period == 0 {
		cfg.Period = 30 * time.Second
	}
	if cfg.Period < 0 {
		return nil, fmt.Errorf("image cache period %v must not be negative", cfg.Period)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg, rt: rt, bus: b, ready: make(chan struct{})}, nil
}

// Ready is closed once the list has been refreshed (or the first refresh failed, logged) and the images
// query and the pull and removal events are subscribed at the server: a query sent after it is answered.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run refreshes at start, every Period, and at once when a pull finishes or GC removes an image on the node
// (pull.pulled, image.removed: the list reflects them within a second; the Period stays as the floor), and
// answers imagefleet.qry.<node>.images until ctx ends.
func (s *Service) Run(ctx context.Context) error {
	log := s.cfg.Logger.With("worker", "cache", "node", s.cfg.Node)
	if err := s.Refresh(ctx); err != nil {
		log.Warn("failed to update image list", "err", err)
	}
	// Every subscription is made here, before Ready: made in the goroutines that use them, one could reach
	// the server after Ready, and a query sent at once found no responders.
	l, err := s.bus.Listen(ctx, events.QuerySubject(s.cfg.Node, events.QryImages), events.CacheQueue, 4, s.handleImages)
	if err != nil {
		return stopped(ctx, err)
	}
	var subs []*bus.Subscription
	for _, subject := range []string{
		events.EventSubject(s.cfg.Node, events.EntityPull, events.ActionPulled),
		events.EventSubject(s.cfg.Node, events.EntityImage, events.ActionRemoved),
	} {
		sub, err := s.bus.SubscribeSync(ctx, subject)
		if err != nil {
			l.Close()
			for _, sub := range subs {
				sub.Close()
			}
			return stopped(ctx, err)
		}
		subs = append(subs, sub)
	}
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel (deferred calls run last first)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- l.Serve(ctx) }()
	wake := make(chan struct{}, 1)
	for _, sub := range subs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer sub.Close()
			sub.Notify(ctx, func() {
				select {
				case wake <- struct{}{}:
				default:
				}
			})
		}()
	}
	s.readyOnce.Do(func() { close(s.ready) })
	tick := time.NewTicker(s.cfg.Period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return <-errc
		case err := <-errc:
			return err
		case <-tick.C:
		case <-wake:
		}
		if err := s.Refresh(ctx); err != nil && ctx.Err() == nil {
			log.Warn("failed to update image list", "err", err)
		}
	}
}

// Refresh lists images and replaces the cached list, sorted.
func (s *Service) Refresh(ctx context.Context) error {
	imgs, err := s.rt.ListImages(ctx)
	if err != nil {
		return fmt.Errorf("update image list: %w", err)
	}
	list := make([]events.Image, 0, len(imgs))
	for _, im := range imgs {
		list = append(list, events.Image{ID: im.ID, RepoTags: im.RepoTags, RepoDigests: im.RepoDigests, Size: im.Size, Pinned: im.Pinned})
	}
	SortBySize(list)
	s.mu.Lock()
	s.images, s.refreshed = list, time.Now().UTC()
	s.mu.Unlock()
	return nil
}

// SortBySize sorts size descending, ties by ID descending (the kubelet's sliceutils.ByImageSize).
func SortBySize(list []events.Image) {
	sort.Slice(list, func(i, j int) bool {
		if list[i].Size == list[j].Size {
			return list[i].ID > list[j].ID
		}
		return list[i].Size > list[j].Size
	})
}

// Images returns the cached list (capped at limit when limit > 0) and when it was refreshed.
func (s *Service) Images(limit int) ([]events.Image, time.Time) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := len(s.images)
	if limit > 0 && limit < n {
		n = limit
	}
	return append([]events.Image(nil), s.images[:n]...), s.refreshed
}

func (s *Service) handleImages(_ context.Context, data []byte) (any, error) {
	var q events.QueryRequest
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	imgs, at := s.Images(q.Limit)
	return events.ImagesReply{Node: s.cfg.Node, Refreshed: at, Images: imgs}, nil
}

// stopped is nil when ctx ended (a shutdown while Run subscribed is a clean one), else err.
func stopped(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}
