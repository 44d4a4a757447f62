package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/distribution/reference"
	"golang.org/x/sync/errgroup"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// InventoryConfig configures a fleet inventory replica.
type InventoryConfig struct {
	// Replica names this replica in logs and query replies (default <hostname>-<pid>).
	Replica string
	// Durable is the shared durable consumer every replica pulls image events from (default
	// "fleet-inventory"). It is API: renaming it re-applies the whole events stream.
	Durable string
	// Concurrency is the number of events this replica applies at once (default 32).
	Concurrency int
	// Replicas of the inventory bucket (3 on a 3-server cluster; 0: the connection's Options.Replicas).
	Replicas int
	// DeliverNew starts a new durable at the end of the events stream instead of its beginning (default
	// false: the inventory is rebuilt from every event the stream still holds).
	DeliverNew bool
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Inventory is one replica of the fleet inventory. Replicas share a durable consumer on every node's image
// events (the server hands each event to one replica), apply it to the inventory bucket with
// compare-and-set guarded by the event's stream sequence (so a redelivered or reordered event changes
// nothing), keep an in-memory index by watching the bucket, and answer queries in one queue group.
type Inventory struct {
	cfg InventoryConfig
	b   *bus.Bus
	kv  *bus.KV

	applied, duplicates, ignored atomic.Int64

	mu    sync.RWMutex
	index map[string]events.Placement // key -> live placement
	ready bool
}

// InventoryStats count what this replica did with the events it was handed.
type InventoryStats struct {
	// Applied events changed the inventory; Duplicates were already applied (or older than what the bucket
	// holds); Ignored are image events the inventory has no use for.
	Applied, Duplicates, Ignored int64
}

// NewInventory validates cfg and opens the inventory bucket.
func NewInventory(ctx context.Context, cfg InventoryConfig, b *bus.Bus) (*Inventory, error) {
	if b == nil {
		return nil, fmt.Errorf("inventory needs a bus")
	}
	if cfg.Concurrency < 0 {
		return nil, fmt.Errorf("inventory concurrency %d must not be negative", cfg.Concurrency)
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = 32
	}
	if cfg.Durable == "" {
		cfg.Durable = events.InventoryDurable
	}
	if cfg.Replica == "" {
		h, _ := os.Hostname()
		cfg.Replica = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	kv, err := b.KV(ctx, inventoryBucket(cfg.Replicas))
	if err != nil {
		return nil, fmt.Errorf("inventory: %w", err)
	}
	return &Inventory{cfg: cfg, b: b, kv: kv, index: map[string]events.Placement{}}, nil
}

func inventoryBucket(replicas int) bus.KVConfig {
	return bus.KVConfig{Bucket: events.InventoryBucket, Replicas: replicas,
		Description: "imagefleet fleet inventory: one key per node and image"}
}

// Stats returns this replica's counters.
func (s *Inventory) Stats() InventoryStats {
	return InventoryStats{Applied: s.applied.Load(), Duplicates: s.duplicates.Load(), Ignored: s.ignored.Load()}
}

// Run applies events, keeps the index and answers queries until ctx ends.
func (s *Inventory) Run(ctx context.Context) error {
	// The first part to fail stops the others; an error after the stop is the stop's, not reported.
	g, ctx := errgroup.WithContext(ctx)
	loaded := make(chan struct{})
	run := func(name string, f func() error) {
		g.Go(func() error {
			if err := f(); err != nil && ctx.Err() == nil {
				return fmt.Errorf("inventory %s: %w", name, err)
			}
			return nil
		})
	}
	run("watch", func() error {
		var once sync.Once
		return s.kv.Watch(ctx, ">", func(e bus.Entry, initialDone bool) {
			if initialDone {
				once.Do(func() {
					s.mu.Lock()
					s.ready = true
					s.mu.Unlock()
					close(loaded)
				})
				return
			}
			s.indexEntry(e)
		})
	})
	run("consume", func() error {
		return s.b.Consume(ctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: s.cfg.Durable,
			FilterSubjects: []string{events.ImageEventsFilter}, MaxAckPending: 4 * s.cfg.Concurrency,
			Concurrency: s.cfg.Concurrency, MaxDeliver: 10,
			Backoff: []time.Duration{100 * time.Millisecond, time.Second, 5 * time.Second}, DeliverNew: s.cfg.DeliverNew},
			s.Apply)
	})
	run("query", func() error {
		// Queries are served only once the index is loaded, so a starting replica never answers from half
		// an inventory while another replica could answer from all of it.
		select {
		case <-ctx.Done():
			return nil
		case <-loaded:
		}
		return s.b.ServeConcurrent(ctx, events.InventoryQuerySubject, events.InventoryQueue, 4, s.Query)
	})
	return g.Wait()
}

// Ready reports whether the index has loaded the bucket's initial contents.
func (s *Inventory) Ready() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.ready
}

func (s *Inventory) indexEntry(e bus.Entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.Deleted {
		delete(s.index, e.Key)
		return
	}
	var p events.Placement
	if err := json.Unmarshal(e.Value, &p); err != nil || p.Gone {
		delete(s.index, e.Key)
		return
	}
	s.index[e.Key] = p
}

// placementKey is the bucket key of image id on node: <node token>.<id as a key token>.
func placementKey(node, id string) string {
	return events.NodeToken(node) + "." + keyToken(id)
}

// keyToken makes an image ID one KV key token: "sha256:<hex>" becomes "sha256_<hex>"; anything with other
// characters becomes "h_" and the SHA-256 of it.
func keyToken(id string) string {
	t := strings.ReplaceAll(id, ":", "_")
	for _, r := range t {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '=') {
			sum := sha256.Sum256([]byte(id))
			return "h_" + hex.EncodeToString(sum[:])
		}
	}
	return t
}

// Apply applies one image event. A malformed event is terminated (dead letter); an event the bucket already
// reflects (same or later stream sequence) is acked without change; a compare-and-set conflict with another
// replica is retried.
func (s *Inventory) Apply(ctx context.Context, m *bus.Msg) error {
	ev, err := events.DecodeEventMsg(m.Header, m.Data)
	if err != nil {
		return bus.Permanent(fmt.Errorf("decode image event: %w", err))
	}
	entity, action, _, err := events.ParseType(ev.Type)
	if err != nil || entity != events.EntityImage {
		s.ignored.Add(1)
		return nil
	}
	var p events.Placement
	switch action {
	case events.ActionDetected:
		var r events.ImageRecord
		if err := ev.DecodeData(&r); err != nil || r.ID == "" {
			return bus.Permanent(fmt.Errorf("image.detected %s: record without an id: %v", ev.ID, err))
		}
		p = events.Placement{Node: ev.Node, ID: r.ID, RepoTags: r.RepoTags, RepoDigests: r.RepoDigests, Size: r.Size,
			Pinned: r.Pinned, InUse: r.InUse, LastUsed: r.LastUsed}
	case events.ActionVanished, events.ActionRemoved:
		var r struct {
			ID string `json:"id"`
		}
		if err := ev.DecodeData(&r); err != nil || r.ID == "" {
			return bus.Permanent(fmt.Errorf("image.%s %s: no image id: %v", action, ev.ID, err))
		}
		p = events.Placement{Node: ev.Node, ID: r.ID, Gone: true}
	default:
		s.ignored.Add(1)
		return nil
	}
	p.Seq = m.StreamSeq
	changed, err := s.put(ctx, p)
	if err != nil {
		return err
	}
	if changed {
		s.applied.Add(1)
	} else {
		s.duplicates.Add(1)
	}
	return nil
}

// put writes p unless the bucket holds the same or a later sequence for its key.
func (s *Inventory) put(ctx context.Context, p events.Placement) (bool, error) {
	key := placementKey(p.Node, p.ID)
	raw, err := json.Marshal(p)
	if err != nil {
		return false, bus.Permanent(fmt.Errorf("marshal placement: %w", err))
	}
	// The common case is an image new to its node: try to create the key first (one round trip), and read
	// and compare-and-set only when it exists.
	if !p.Gone {
		if _, err := s.kv.Create(ctx, key, raw); err == nil {
			return true, nil
		} else if !errors.Is(err, bus.ErrConflict) {
			return false, err
		}
	}
	for attempt := 0; attempt < 8; attempt++ {
		cur, rev, err := s.kv.Get(ctx, key)
		switch {
		case errors.Is(err, bus.ErrKeyNotFound):
			if _, err := s.kv.Create(ctx, key, raw); err != nil {
				if errors.Is(err, bus.ErrConflict) {
					continue
				}
				return false, err
			}
			return true, nil
		case err != nil:
			return false, err
		}
		var old events.Placement
		if json.Unmarshal(cur, &old) == nil && old.Seq >= p.Seq {
			return false, nil
		}
		if _, err := s.kv.Update(ctx, key, raw, rev); err != nil {
			if errors.Is(err, bus.ErrConflict) {
				continue
			}
			return false, err
		}
		return true, nil
	}
	return false, fmt.Errorf("apply %s: too many conflicting writers", key)
}

// Query answers an inventory query from the in-memory index.
func (s *Inventory) Query(_ context.Context, data []byte) (any, error) {
	var q events.InventoryQuery
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	s.mu.RLock()
	placements := make([]events.Placement, 0, len(s.index))
	for _, p := range s.index {
		placements = append(placements, p)
	}
	s.mu.RUnlock()
	rep, err := Answer(q, placements)
	if err != nil {
		return nil, err
	}
	rep.Replica = s.cfg.Replica
	return rep, nil
}

// Answer computes an inventory reply from live placements (a pure function).
func Answer(q events.InventoryQuery, placements []events.Placement) (events.InventoryReply, error) {
	var rep events.InventoryReply
	switch q.What {
	case events.InventoryImages:
		byID := map[string]*events.InventoryImage{}
		for _, p := range placements {
			im := byID[p.ID]
			if im == nil {
				im = &events.InventoryImage{ID: p.ID, Size: p.Size}
				byID[p.ID] = im
			}
			im.Nodes++
			im.TotalBytes += p.Size
			im.Size = max(im.Size, p.Size)
			im.RepoTags = union(im.RepoTags, p.RepoTags)
			im.RepoDigests = union(im.RepoDigests, p.RepoDigests)
			if p.LastUsed.After(im.LastUsed) {
				im.LastUsed = p.LastUsed
			}
		}
		for _, im := range byID {
			rep.Images = append(rep.Images, *im)
			rep.TotalBytes += im.TotalBytes
		}
		sort.Slice(rep.Images, func(i, j int) bool {
			a, b := rep.Images[i], rep.Images[j]
			if a.TotalBytes != b.TotalBytes {
				return a.TotalBytes > b.TotalBytes
			}
			return a.ID < b.ID
		})
		rep.Total = len(rep.Images)
		if q.Limit > 0 && len(rep.Images) > q.Limit {
			rep.Images = rep.Images[:q.Limit]
		}
	case events.InventoryNodes:
		byNode := map[string]*events.InventoryNode{}
		for _, p := range placements {
			n := byNode[p.Node]
			if n == nil {
				n = &events.InventoryNode{Node: p.Node}
				byNode[p.Node] = n
			}
			n.Images++
			n.TotalBytes += p.Size
		}
		for _, n := range byNode {
			rep.Nodes = append(rep.Nodes, *n)
			rep.TotalBytes += n.TotalBytes
		}
		sort.Slice(rep.Nodes, func(i, j int) bool { return rep.Nodes[i].Node < rep.Nodes[j].Node })
		rep.Total = len(rep.Nodes)
		if q.Limit > 0 && len(rep.Nodes) > q.Limit {
			rep.Nodes = rep.Nodes[:q.Limit]
		}
	case events.InventoryWhere:
		m := newImageMatcher(q.Image)
		for _, p := range placements {
			if m.matches(p) {
				rep.Placements = append(rep.Placements, p)
				rep.TotalBytes += p.Size
			}
		}
		sort.Slice(rep.Placements, func(i, j int) bool {
			a, b := rep.Placements[i], rep.Placements[j]
			if a.Node != b.Node {
				return a.Node < b.Node
			}
			return a.ID < b.ID
		})
		rep.Total = len(rep.Placements)
		if q.Limit > 0 && len(rep.Placements) > q.Limit {
			rep.Placements = rep.Placements[:q.Limit]
		}
	default:
		return rep, fmt.Errorf("%w: what %q must be images, where or nodes", events.ErrMalformed, q.What)
	}
	return rep, nil
}

func union(a, b []string) []string {
	for _, s := range b {
		found := false
		for _, t := range a {
			if s == t {
				found = true
				break
			}
		}
		if !found {
			a = append(a, s)
		}
	}
	return a
}

// imageMatcher matches an image by ID, unique-enough ID prefix, tag or digest reference (normalized the
// way the runtime reports them: nginx is docker.io/library/nginx:latest).
type imageMatcher struct {
	raw, normalized, idPrefix string
}

func newImageMatcher(s string) imageMatcher {
	m := imageMatcher{raw: strings.TrimSpace(s)}
	hexPart := strings.TrimPrefix(m.raw, "sha256:")
	if len(hexPart) >= 6 && isHex(hexPart) {
		m.idPrefix = "sha256:" + hexPart
	}
	if named, err := reference.ParseNormalizedNamed(m.raw); err == nil {
		m.normalized = reference.TagNameOnly(named).String()
	}
	return m
}

func isHex(s string) bool {
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') {
			return false
		}
	}
	return true
}

func (m imageMatcher) matches(p events.Placement) bool {
	if p.ID == m.raw || (m.idPrefix != "" && strings.HasPrefix(p.ID, m.idPrefix)) {
		return true
	}
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			if r == m.raw || (m.normalized != "" && r == m.normalized) {
				return true
			}
		}
	}
	return false
}
