package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strconv"
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
	// Partitioned consumes the image events through the 16 partition durables on events.InventoryStream
	// (the server's partitioned copy of the image events) instead of the one durable (Durable) on the events
	// stream shared by every replica. Each replica owns a share of the partitions (leases in
	// events.InventoryOwnersBucket, owners.go), consumes and indexes only those, and a query is gathered from
	// every replica's part (inventory_owned.go). Default false: on this project's 2-core machine with three
	// servers both ways caught up at about the same rate uncapped, the cores the limit
	// (docs/runs/2026-11-inventory.md), so the partitions are opt-in until measured on servers with cores
	// of their own.
	Partitioned bool
	// Durable is the shared durable consumer (default "fleet-inventory"). It is API: renaming it re-applies
	// the whole events stream.
	Durable string
	// Concurrency is the number of events this replica applies at once (default 32; Partitioned: 256 over
	// the 16 partitions, ceil(256/16) = 16 for each partition it owns: a partition's handlers are also its
	// pull batch, and at 2 each the servers handled 27-29 messages per event instead of 14).
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
// Partitioned replicas each consume, index and answer for the partitions they own (InventoryConfig.Partitioned).
//
// Keys are image first (events.InventoryKey), so `where` reads only the keys of the images asked for. A key
// of the previous release's node-first layout (events.InventoryNodeFirstKey), found at start or written
// later by a replica of that release still running, is re-keyed: copied to its image-first key under the
// same sequence guard, then deleted if unchanged since it was read.
type Inventory struct {
	cfg InventoryConfig
	b   *bus.Bus
	kv  *bus.KV

	applied, duplicates, ignored, rekeyed atomic.Int64

	// The index mirrors the bucket's image-first layout: the placements of one image are one map, so where
	// reads only them (BenchmarkInventoryQueries: faster than the same filtered read from the bucket, whose
	// keys of one image are spread over the whole stream).
	mu    sync.RWMutex
	index map[string]map[string]indexed // image token -> node token -> placement (Gone: a tombstone)
	refs  map[string]map[string]int     // repo tag or digest -> image ID -> live placements
	// Totals kept up to date with the index, so images and nodes answer in O(images) and O(nodes).
	images map[string]*imageTotals          // image ID -> its live placements' totals
	nodes  map[string]*events.InventoryNode // node name -> its live placements' totals
	// The IDs of images, sorted, for a part's chunks (sortedImageIDs); nil once an image comes or goes.
	imageIDs []string
	ready    bool
	// readyCh closes when ready first turns true (Ready).
	readyCh   chan struct{}
	readyOnce sync.Once

	// Partitioned (inventory_owned.go): what this replica has of each partition, a generation bumped at
	// every acquire and release (a range reading a partition taken over indexes only while it is current),
	// the partitions the initial watch loads, and whether it has started.
	own      [events.InventoryPartitions]partState
	gen      [events.InventoryPartitions]uint64
	viaWatch [events.InventoryPartitions]bool
	watching bool
	// The partition consumers, started and stopped as partitions come and go, under cmu.
	runCtx    context.Context
	cmu       sync.Mutex
	consumers [events.InventoryPartitions]context.CancelFunc
	cwg       sync.WaitGroup // the partition consumers and range loads, waited for by Run
	stopped   bool           // under cmu: Run is ending, nothing more is started
	fail      chan error
	owners    *owners
	// Node-first keys seen after the initial load (by the watch, or by the range of a partition taken
	// over), for the re-keyer.
	rekeyLive *rekeyQueue
}

// indexed is a placement in the index with the bucket revision of its image-first key (0: not known, the
// placement was read from a node-first key), so an apply writes with compare-and-set on it directly instead
// of reading the key first.
type indexed struct {
	events.Placement
	rev uint64
}

// imageTotals sums one image's live placements.
type imageTotals struct {
	nodes         int
	bytes         int64
	size          int64     // the largest size reported
	lastUsed      time.Time // the latest use
	stale         bool      // a removed placement held size or lastUsed: recomputed from the index when asked
	tags, digests map[string]int
}

// legacyEntry is a node-first key to re-key.
type legacyEntry struct {
	key string
	rev uint64
	p   events.Placement
}

// rekeyWorkers is how many node-first keys a replica re-keys at once.
const rekeyWorkers = 4

// InventoryStats count what this replica did with the events it was handed.
type InventoryStats struct {
	// Applied events changed the inventory; Duplicates were already applied (or older than what the bucket
	// holds); Ignored are image events the inventory has no use for; Rekeyed are node-first keys of the
	// previous release moved to their image-first key.
	Applied, Duplicates, Ignored, Rekeyed int64
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
		if cfg.Partitioned {
			cfg.Concurrency = 256
		}
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
	s := newInventory(cfg)
	s.b, s.kv = b, kv
	if cfg.Partitioned {
		if err := EnsureInventoryStream(ctx, b, cfg.Replicas); err != nil {
			return nil, fmt.Errorf("inventory: %w", err)
		}
		okv, err := b.KV(ctx, ownersBucket(cfg.Replicas))
		if err != nil {
			return nil, fmt.Errorf("inventory: %w", err)
		}
		s.owners = newOwners(okv, cfg.Replica, cfg.Logger, s.partitionsChanged)
	}
	return s, nil
}

// newInventory is an inventory with an empty index, not yet connected (NewInventory connects it).
func newInventory(cfg InventoryConfig) *Inventory {
	return &Inventory{cfg: cfg, index: map[string]map[string]indexed{}, refs: map[string]map[string]int{},
		images: map[string]*imageTotals{}, nodes: map[string]*events.InventoryNode{}, fail: make(chan error, 1),
		rekeyLive: newRekeyQueue(), readyCh: make(chan struct{})}
}

func inventoryBucket(replicas int) bus.KVConfig {
	return bus.KVConfig{Bucket: events.InventoryBucket, Replicas: replicas,
		Description: "imagefleet fleet inventory: one key per node and image"} // unchanged: an opener whose settings differ updates the bucket
}

// Stats returns this replica's counters.
func (s *Inventory) Stats() InventoryStats {
	return InventoryStats{Applied: s.applied.Load(), Duplicates: s.duplicates.Load(), Ignored: s.ignored.Load(),
		Rekeyed: s.rekeyed.Load()}
}

// Run applies events, keeps the index and answers queries until ctx ends.
func (s *Inventory) Run(ctx context.Context) error {
	// The first part to fail stops the others; an error after the stop is the stop's, not reported.
	g, ctx := errgroup.WithContext(ctx)
	s.runCtx = ctx
	// indexed: the index holds the bucket's initial contents. loaded: and the replica listens for queries
	// (ready); events are applied and partitions consumed from then on.
	indexed, loaded := make(chan struct{}), make(chan struct{})
	run := func(name string, f func() error) {
		g.Go(func() error {
			if err := f(); err != nil && ctx.Err() == nil {
				return fmt.Errorf("inventory %s: %w", name, err)
			}
			return nil
		})
	}
	// Node-first keys of the previous release: those found by the initial load are re-keyed by one pass over
	// the bucket once the index is loaded (streamed, not held: at the first start after an upgrade that is
	// every placement of the fleet); those written later by a replica of that release still running are
	// queued by the watch (a few) and re-keyed as they come. Neither holds up the watch, events or queries.
	var atStart atomic.Bool
	live := s.rekeyLive
	if s.owners != nil {
		// Partitioned: the partitions are taken first, so the initial watch loads just theirs.
		run("owners", func() error { return s.owners.run(ctx) })
		run("partition consumers", func() error {
			select {
			case <-ctx.Done():
				return nil
			case err := <-s.fail:
				return err
			}
		})
	}
	run("watch", func() error {
		if s.owners != nil {
			select {
			case <-ctx.Done():
				return nil
			case <-s.owners.first:
			}
		}
		s.mu.Lock()
		s.watching = true
		s.mu.Unlock()
		var once sync.Once
		loadedAll := false // the watch callback's own: the initial values are done
		return s.kv.Watch(ctx, ">", func(e bus.Entry, initialDone bool) {
			if initialDone {
				// A node-first key is indexed under its image-first key at once: the index is whole now,
				// whether or not the re-keying is done.
				loadedAll = true
				once.Do(func() { close(indexed) })
				return
			}
			p, ok := s.indexEntry(e)
			switch {
			case !ok:
			case !loadedAll:
				atStart.Store(true)
			default:
				live.push(legacyEntry{key: e.Key, rev: e.Revision, p: p})
			}
		})
	})
	run("rekey", func() error {
		if !waitLoaded(ctx, indexed) {
			return nil
		}
		if atStart.Load() {
			if err := s.rekeyAll(ctx); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Warn("inventory re-key pass failed; the next start tries again", "err", err)
			}
		}
		for {
			les, ok := live.wait(ctx)
			if !ok {
				return nil
			}
			for _, le := range les {
				if err := s.rekey(ctx, le); err != nil && ctx.Err() == nil {
					s.cfg.Logger.Warn("inventory re-key failed", "key", le.key, "err", err)
				}
			}
		}
	})
	// Events are applied once the index is loaded: an apply reads the key's sequence and revision from the
	// index (an event the bucket already reflects costs no request; another is one compare-and-set). Either
	// way an applied event is acked without waiting for the server's confirmation (AsyncAck): the apply is
	// idempotent (the sequence guard), so an ack the server never got only redelivers an event whose second
	// apply changes nothing, and a handler's slot is not held for the ack's Raft round on the consumer's
	// group (~10 ms of the ~25 ms an event held it during a catch-up: docs/benchmarks.md).
	if !s.cfg.Partitioned {
		run("consume", func() error {
			if !waitLoaded(ctx, loaded) {
				return nil
			}
			return s.b.Consume(ctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: s.cfg.Durable,
				FilterSubjects: []string{events.ImageEventsFilter}, MaxAckPending: 4 * s.cfg.Concurrency,
				Concurrency: s.cfg.Concurrency, MaxDeliver: 10, Backoff: inventoryBackoff, DeliverNew: s.cfg.DeliverNew,
				AsyncAck: true},
				s.Apply)
		})
	}
	run("query", func() error {
		// Queries are listened for only once the index is loaded, so a starting replica never answers from
		// half an inventory while another replica could answer from all of it. The replica says it is ready
		// (Ready, Owned, events applied) only once the server holds its subscriptions, so a query sent on
		// that word finds a responder instead of being refused with no responders.
		if !waitLoaded(ctx, indexed) {
			return nil
		}
		ls, err := s.listen(ctx)
		if err != nil {
			return err
		}
		s.mu.Lock()
		s.ready = true
		ready := s.initialLoaded()
		s.mu.Unlock()
		s.readyOnce.Do(func() { close(s.readyCh) })
		for _, p := range ready {
			s.startConsumer(p)
		}
		close(loaded)
		var wg sync.WaitGroup
		for _, l := range ls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = l.Serve(ctx) // nil once ctx ends
			}()
		}
		wg.Wait()
		return nil
	})
	err := g.Wait() // ends ctx, so the partition consumers and range loads end too
	s.cmu.Lock()
	s.stopped = true
	s.cmu.Unlock()
	s.cwg.Wait()
	return err
}

// listen subscribes to every subject this replica answers: queries, in their queue group, and (partitioned)
// parts, which every replica answers. A listener is registered at the server when it is returned.
func (s *Inventory) listen(ctx context.Context) ([]*bus.Listener, error) {
	q, err := s.b.Listen(ctx, events.InventoryQuerySubject, events.InventoryQueue, 4, s.Query)
	if err != nil {
		return nil, err
	}
	if s.owners == nil {
		return []*bus.Listener{q}, nil
	}
	parts, err := s.b.Listen(ctx, events.InventoryPartsSubject, "", 4, s.Part)
	if err != nil {
		q.Close()
		return nil, err
	}
	return []*bus.Listener{q, parts}, nil
}

// inventoryBackoff is the redelivery backoff of an event whose apply failed.
var inventoryBackoff = []time.Duration{100 * time.Millisecond, time.Second, 5 * time.Second}

// inventoryPartitionMaxAckPending bounds a partition durable's events in flight: its owner's 16 handlers,
// with room for a previous owner's unacked events during a handover (and for replicas of the previous
// release, which pulled from every partition, 16 of them at 16 each). An event counts from its delivery until the server has its ack; with the
// acks not waited for (AsyncAck), a replica's handlers may start new events while acks of theirs are still
// on the way, and the server holds back deliveries past the bound as before.
const inventoryPartitionMaxAckPending = 256

// inventoryStallAfter is the partitions' StallAfter: how long a partition whose pull request never reached
// its consumer's leader sits idle before the replica pulls anew. A partition durable just created on a
// cluster sometimes lost its replica's first pull request (no pull request waiting at the server, the
// whole partition pending); with the bus's default of 15 s the catch-up waited 15-20 s for that one
// partition (docs/benchmarks.md: 20.9 s instead of ~5 s at 1 replica), the other 15 long done. The price is
// the watchdog's consumer info requests: a look 2 s after a partition's last delivery, then at periods that
// double up to 5 minutes, 16 per replica at most per period.
const inventoryStallAfter = 2 * time.Second

// inventoryAckWait is how long a partition's copy stays with a replica that stopped answering before the
// server hands it to another (an apply takes milliseconds; the shared durable keeps the default 30 s).
const inventoryAckWait = 10 * time.Second

func waitLoaded(ctx context.Context, loaded <-chan struct{}) bool {
	select {
	case <-ctx.Done():
		return false
	case <-loaded:
		return true
	}
}

// EnsureInventoryStream creates events.InventoryStream, the server's partitioned copy of every node's image
// events, or brings an earlier one to this release's settings in place (imagefleet bus init
// --inventory-partitioned, and every partitioned inventory replica at start). replicas 0: the connection's
// Options.Replicas.
func EnsureInventoryStream(ctx context.Context, b *bus.Bus, replicas int) error {
	return b.EnsureSourcedStream(ctx, bus.SourcedStreamConfig{
		Name: events.InventoryStream,
		Description: fmt.Sprintf("image events of %s, partitioned by node into %d for the fleet inventory",
			events.EventsStream, events.InventoryPartitions),
		Origin: events.EventsStream, Filter: events.InventorySourceFilter, Transform: events.InventorySourceTransform(),
		// A copy is dropped once applied; the limits only bound a backlog no inventory drains.
		WorkQueue: true, MaxAge: 7 * 24 * time.Hour, MaxBytes: 1 << 30, Replicas: replicas,
	})
}

// MigrateInventoryStream brings an existing events.InventoryStream to this release's settings and creates
// none: what imagefleet bus init does without --inventory-partitioned (a copy nobody drains would fill up).
func MigrateInventoryStream(ctx context.Context, b *bus.Bus, replicas int) error {
	if _, err := b.Stream(ctx, events.InventoryStream); err != nil {
		if bus.IsStreamNotFound(err) {
			return nil
		}
		return err
	}
	return EnsureInventoryStream(ctx, b, replicas)
}

// Ready closes once the replica answers queries: its index holds the bucket's initial contents and the
// server holds its subscriptions (queries; partitioned, parts too), so a query sent through the same server
// from then on finds a responder (a cluster's other servers learn of the interest a route round trip later).
// The agent's /healthz waits for it.
func (s *Inventory) Ready() <-chan struct{} { return s.readyCh }

// indexEntry applies one bucket change to the index. A node-first key of the previous release is indexed
// under its image-first key and returned for re-keying (ok); a value that is no placement, or whose key is
// neither of its two keys, is ignored.
func (s *Inventory) indexEntry(e bus.Entry) (legacy events.Placement, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.Deleted {
		// Only image-first keys are in the index; a deleted node-first key was re-keyed (its placement is
		// under its image-first key now).
		s.drop(e.Key)
		return legacy, false
	}
	if s.foreignKey(e.Key) {
		return legacy, false
	}
	// This replica's own write comes back from the watch with the revision it was indexed under (wrote):
	// a bucket revision names one write, so it is not decoded again. (A shared-durable replica decodes
	// every other replica's writes: that is what its whole-fleet index costs, docs/benchmarks.md; a
	// partitioned one only those of its partitions, foreignKey.)
	if img, node, found := strings.Cut(e.Key, "."); found && e.Revision > 0 {
		if cur, ok := s.index[img][node]; ok && cur.rev == e.Revision {
			return legacy, false
		}
	}
	var p events.Placement
	if err := json.Unmarshal(e.Value, &p); err != nil || p.Node == "" || p.ID == "" {
		s.drop(e.Key)
		return legacy, false
	}
	return s.indexPlacement(e.Key, p, e.Revision)
}

// indexPlacement indexes p, read from key at revision rev (s.mu held); see indexEntry.
func (s *Inventory) indexPlacement(key string, p events.Placement, rev uint64) (legacy events.Placement, ok bool) {
	switch key {
	case events.InventoryKey(p.ID, p.Node):
	case events.InventoryNodeFirstKey(p.Node, p.ID):
		ok = true
	default:
		return legacy, false
	}
	if !s.ownsNode(p.Node) {
		return legacy, false
	}
	img, node := events.InventoryImageToken(p.ID), events.NodeToken(p.Node)
	nodes := s.index[img]
	if nodes == nil {
		nodes = map[string]indexed{}
		s.index[img] = nodes
	}
	cur, found := nodes[node]
	if found && cur.Seq > p.Seq {
		return p, ok
	}
	if found {
		s.unref(cur.Placement)
	}
	if ok {
		rev = 0 // the node-first key's revision, not the image-first key's
	}
	if p.Gone {
		nodes[node] = indexed{events.Placement{Node: p.Node, ID: p.ID, Seq: p.Seq, Gone: true}, rev}
		return p, ok
	}
	nodes[node] = indexed{p, rev}
	s.ref(p)
	return p, ok
}

// ref counts a live placement into the references and totals (s.mu held).
func (s *Inventory) ref(p events.Placement) {
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			m := s.refs[r]
			if m == nil {
				m = map[string]int{}
				s.refs[r] = m
			}
			m[p.ID]++
		}
	}
	im := s.images[p.ID]
	if im == nil {
		im = &imageTotals{tags: map[string]int{}, digests: map[string]int{}}
		s.images[p.ID] = im
		s.imageIDs = nil
	}
	im.nodes++
	im.bytes += p.Size
	im.size = max(im.size, p.Size)
	if p.LastUsed.After(im.lastUsed) {
		im.lastUsed = p.LastUsed
	}
	for _, t := range p.RepoTags {
		im.tags[t]++
	}
	for _, d := range p.RepoDigests {
		im.digests[d]++
	}
	n := s.nodes[p.Node]
	if n == nil {
		n = &events.InventoryNode{Node: p.Node}
		s.nodes[p.Node] = n
	}
	n.Images++
	n.TotalBytes += p.Size
}

// drop removes an image-first key's placement from the index (s.mu held).
func (s *Inventory) drop(key string) {
	img, node, _ := strings.Cut(key, ".")
	nodes := s.index[img]
	cur, found := nodes[node]
	if !found {
		return
	}
	s.unref(cur.Placement)
	delete(nodes, node)
	if len(nodes) == 0 {
		delete(s.index, img)
	}
}

// unref takes a live placement out of the ID and reference counts (s.mu held).
func (s *Inventory) unref(p events.Placement) {
	if p.Gone {
		return
	}
	if im := s.images[p.ID]; im != nil {
		im.nodes--
		im.bytes -= p.Size
		im.stale = im.stale || p.Size == im.size || p.LastUsed.Equal(im.lastUsed)
		uncount(im.tags, p.RepoTags)
		uncount(im.digests, p.RepoDigests)
		if im.nodes <= 0 {
			delete(s.images, p.ID)
			s.imageIDs = nil
		}
	}
	if n := s.nodes[p.Node]; n != nil {
		n.Images--
		n.TotalBytes -= p.Size
		if n.Images <= 0 {
			delete(s.nodes, p.Node)
		}
	}
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			if m := s.refs[r]; m != nil {
				if m[p.ID]--; m[p.ID] <= 0 {
					delete(m, p.ID)
				}
				if len(m) == 0 {
					delete(s.refs, r)
				}
			}
		}
	}
}

func uncount(m map[string]int, keys []string) {
	for _, k := range keys {
		if m[k]--; m[k] <= 0 {
			delete(m, k)
		}
	}
}

// imageTotal returns image id's fleet totals, recomputing its largest size and latest use from its
// placements if a removal made them stale (s.mu held for writing).
func (s *Inventory) imageTotal(id string, im *imageTotals) events.InventoryImage {
	if im.stale {
		im.size, im.lastUsed, im.stale = 0, time.Time{}, false
		for _, p := range s.index[events.InventoryImageToken(id)] {
			if !p.Gone && p.ID == id {
				im.size = max(im.size, p.Size)
				if p.LastUsed.After(im.lastUsed) {
					im.lastUsed = p.LastUsed
				}
			}
		}
	}
	return events.InventoryImage{ID: id, RepoTags: sortedKeys(im.tags), RepoDigests: sortedKeys(im.digests), Size: im.size,
		Nodes: im.nodes, TotalBytes: im.bytes, LastUsed: im.lastUsed}
}

func sortedKeys(m map[string]int) []string {
	if len(m) == 0 {
		return nil
	}
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// rekeyAll re-keys every node-first key of the bucket, streaming it, rekeyWorkers at a time.
func (s *Inventory) rekeyAll(ctx context.Context) error {
	work := make(chan legacyEntry)
	var wg sync.WaitGroup
	for range rekeyWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for le := range work {
				if err := s.rekey(ctx, le); err != nil && ctx.Err() == nil {
					s.cfg.Logger.Warn("inventory re-key failed", "key", le.key, "err", err)
				}
			}
		}()
	}
	err := s.kv.Range(ctx, ">", func(e bus.Entry) bool {
		var p events.Placement
		if json.Unmarshal(e.Value, &p) != nil || p.Node == "" || p.ID == "" || e.Key != events.InventoryNodeFirstKey(p.Node, p.ID) {
			return true
		}
		select {
		case work <- legacyEntry{key: e.Key, rev: e.Revision, p: p}:
			return true
		case <-ctx.Done():
			return false
		}
	})
	close(work)
	wg.Wait()
	return err
}

// rekeyQueue holds node-first keys the watch saw after the initial load, for the re-keyer.
type rekeyQueue struct {
	mu     sync.Mutex
	queued []legacyEntry
	signal chan struct{}
}

func newRekeyQueue() *rekeyQueue { return &rekeyQueue{signal: make(chan struct{}, 1)} }

func (q *rekeyQueue) push(le legacyEntry) {
	q.mu.Lock()
	q.queued = append(q.queued, le)
	q.mu.Unlock()
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

// wait returns the queued entries once there are some, or false when ctx ends.
func (q *rekeyQueue) wait(ctx context.Context) ([]legacyEntry, bool) {
	for {
		q.mu.Lock()
		les := q.queued
		q.queued = nil
		q.mu.Unlock()
		if len(les) > 0 {
			return les, true
		}
		select {
		case <-ctx.Done():
			return nil, false
		case <-q.signal:
		}
	}
}

// rekey moves a node-first key to its image-first key: the placement is written there under the sequence
// guard (a later one already there wins), then the old key is deleted only if no replica of the previous
// release rewrote it meanwhile (if one did, the watch brings the new value, which is re-keyed in turn).
func (s *Inventory) rekey(ctx context.Context, le legacyEntry) error {
	if _, err := s.write(ctx, le.p, false); err != nil {
		return err
	}
	if err := s.kv.DeleteIf(ctx, le.key, le.rev); err != nil && !errors.Is(err, bus.ErrConflict) {
		return err
	}
	s.rekeyed.Add(1)
	return nil
}

// placementKey is the bucket key of image id on node: image first, <image token>.<node token>.
func placementKey(node, id string) string { return events.InventoryKey(id, node) }

// ApplyCopy applies one image event copied into events.InventoryStream: as Apply, guarded by the event's
// sequence in the events stream (the copy's Nats-Stream-Source header), not the copy's own.
func (s *Inventory) ApplyCopy(ctx context.Context, m *bus.Msg) error {
	seq, err := events.SourceSequence(m.Header.Get(sourceHeader), events.EventsStream)
	if err != nil {
		return bus.Permanent(fmt.Errorf("inventory copy %s: %w", m.Subject, err))
	}
	return s.apply(ctx, m, seq)
}

// sourceHeader is nats-server's header on a sourced message: the origin stream and sequence.
const sourceHeader = "Nats-Stream-Source"

// Apply applies one image event. A malformed event is terminated (dead letter); an event the bucket already
// reflects (same or later stream sequence) is acked without change; a compare-and-set conflict with another
// replica is retried.
func (s *Inventory) Apply(ctx context.Context, m *bus.Msg) error { return s.apply(ctx, m, m.StreamSeq) }

func (s *Inventory) apply(ctx context.Context, m *bus.Msg, seq uint64) error {
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
	p.Seq = seq
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
	return s.write(ctx, p, true)
}

// write is put; withIndex false reads the bucket instead of the index (the re-keyer's case: the index holds
// the node-first placement it moves under the image-first key already).
func (s *Inventory) write(ctx context.Context, p events.Placement, withIndex bool) (bool, error) {
	key := placementKey(p.Node, p.ID)
	raw, err := json.Marshal(p)
	if err != nil {
		return false, bus.Permanent(fmt.Errorf("marshal placement: %w", err))
	}
	// One request in the common cases: the index (which only ever lags the bucket) says whether the bucket
	// already holds this sequence or a later one (no request), the revision to compare-and-set on, or that
	// the key is new (create). Only when the index lagged is the key read.
	var cur indexed
	known := false
	if withIndex {
		cur, known = s.lookup(p)
	}
	switch {
	case known && cur.Seq >= p.Seq:
		return false, nil
	case known && cur.rev > 0:
		if rev, err := s.kv.Update(ctx, key, raw, cur.rev); err == nil {
			s.wrote(key, p, rev)
			return true, nil
		} else if !errors.Is(err, bus.ErrConflict) {
			return false, err
		}
	case !known && !p.Gone:
		if rev, err := s.kv.Create(ctx, key, raw); err == nil {
			s.wrote(key, p, rev)
			return true, nil
		} else if !errors.Is(err, bus.ErrConflict) {
			return false, err
		}
	}
	for attempt := 0; attempt < 8; attempt++ {
		cur, rev, err := s.kv.Get(ctx, key)
		switch {
		case errors.Is(err, bus.ErrKeyNotFound):
			nrev, err := s.kv.Create(ctx, key, raw)
			if err != nil {
				if errors.Is(err, bus.ErrConflict) {
					continue
				}
				return false, err
			}
			s.wrote(key, p, nrev)
			return true, nil
		case err != nil:
			return false, err
		}
		var old events.Placement
		if json.Unmarshal(cur, &old) == nil && old.Seq >= p.Seq {
			return false, nil
		}
		nrev, err := s.kv.Update(ctx, key, raw, rev)
		if err != nil {
			if errors.Is(err, bus.ErrConflict) {
				continue
			}
			return false, err
		}
		s.wrote(key, p, nrev)
		return true, nil
	}
	return false, fmt.Errorf("apply %s: too many conflicting writers", key)
}

// lookup returns the index's placement of p's image on p's node.
func (s *Inventory) lookup(p events.Placement) (indexed, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	cur, ok := s.index[events.InventoryImageToken(p.ID)][events.NodeToken(p.Node)]
	return cur, ok
}

// wrote indexes what this replica just wrote, so its next apply to the key compares and sets on the new
// revision without waiting for the watch (which brings the same entry again, recognized by its revision).
func (s *Inventory) wrote(key string, p events.Placement, rev uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.indexPlacement(key, p, rev)
}

// Query answers an inventory query from the in-memory index: where reads only the placements of the image
// IDs the query names; images and nodes read the per-image and per-node totals kept with the index. A
// partitioned replica gathers the answer from every replica's part (gather).
func (s *Inventory) Query(ctx context.Context, data []byte) (any, error) {
	var q events.InventoryQuery
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	if q.What == events.InventoryWhere || s.owners != nil {
		if err := q.Validate(); err != nil {
			return nil, fmt.Errorf("%w: %v", events.ErrMalformed, err)
		}
	}
	if s.owners != nil {
		rep, err := s.gather(ctx, q)
		if err != nil {
			return nil, err
		}
		rep.Replica = s.cfg.Replica
		return rep, nil
	}
	var rep events.InventoryReply
	var err error
	switch q.What {
	case events.InventoryWhere:
		ids := s.resolve(q.Image)
		s.mu.RLock()
		rep, err = answer(q, func(yield func(events.Placement)) {
			for _, id := range ids {
				for _, p := range s.index[events.InventoryImageToken(id)] {
					if !p.Gone && p.ID == id {
						yield(p.Placement)
					}
				}
			}
		})
		s.mu.RUnlock()
	case events.InventoryImages:
		s.mu.Lock() // imageTotal may recompute a stale total
		list := make([]events.InventoryImage, 0, len(s.images))
		for id, im := range s.images {
			list = append(list, s.imageTotal(id, im))
		}
		s.mu.Unlock()
		rep, err = pageImages(q, list)
	case events.InventoryNodes:
		s.mu.RLock()
		list := make([]events.InventoryNode, 0, len(s.nodes))
		for _, n := range s.nodes {
			list = append(list, *n)
		}
		s.mu.RUnlock()
		rep, err = pageNodes(q, list)
	default:
		rep, err = answer(q, func(func(events.Placement)) {})
	}
	if err != nil {
		return nil, err
	}
	rep.Replica = s.cfg.Replica
	return rep, nil
}

// resolve turns an image ID, an ID prefix of at least 6 hex digits, a tag or a digest reference into the
// image IDs the index knows by it, sorted. A full ID is kept even if the index does not know it yet.
func (s *Inventory) resolve(image string) []string {
	m := newImageMatcher(image)
	found := map[string]bool{}
	if isFullID(m.raw) {
		found[m.raw] = true
	}
	s.mu.RLock()
	if s.images[m.raw] != nil {
		found[m.raw] = true
	}
	if m.idPrefix != "" {
		for id := range s.images {
			if strings.HasPrefix(id, m.idPrefix) {
				found[id] = true
			}
		}
	}
	for _, r := range []string{m.raw, m.normalized} {
		for id := range s.refs[r] {
			found[id] = true
		}
	}
	s.mu.RUnlock()
	out := make([]string, 0, len(found))
	for id := range found {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// Answer computes an inventory reply from live placements (a pure function: where scans them all).
func Answer(q events.InventoryQuery, placements []events.Placement) (events.InventoryReply, error) {
	if q.What == events.InventoryWhere {
		m := newImageMatcher(q.Image)
		return answer(q, func(yield func(events.Placement)) {
			for _, p := range placements {
				if m.matches(p) {
					yield(p)
				}
			}
		})
	}
	return answer(q, func(yield func(events.Placement)) {
		for _, p := range placements {
			yield(p)
		}
	})
}

// answer aggregates the placements each yields (for where: the matching ones) into a reply, sorted, and
// keeps the page after q.Continue of at most q.Limit entries. Total and TotalBytes count every page.
func answer(q events.InventoryQuery, each func(yield func(events.Placement))) (events.InventoryReply, error) {
	var rep events.InventoryReply
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	switch q.What {
	case events.InventoryImages:
		byID := map[string]*events.InventoryImage{}
		each(func(p events.Placement) {
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
		})
		list := make([]events.InventoryImage, 0, len(byID))
		for _, im := range byID {
			sort.Strings(im.RepoTags) // sorted, as a replica's totals give them (sortedKeys)
			sort.Strings(im.RepoDigests)
			list = append(list, *im)
		}
		return pageImages(q, list)
	case events.InventoryNodes:
		byNode := map[string]*events.InventoryNode{}
		each(func(p events.Placement) {
			n := byNode[p.Node]
			if n == nil {
				n = &events.InventoryNode{Node: p.Node}
				byNode[p.Node] = n
			}
			n.Images++
			n.TotalBytes += p.Size
		})
		list := make([]events.InventoryNode, 0, len(byNode))
		for _, n := range byNode {
			list = append(list, *n)
		}
		return pageNodes(q, list)
	case events.InventoryWhere:
		each(func(p events.Placement) {
			rep.Placements = append(rep.Placements, p)
			rep.TotalBytes += p.Size
		})
		sort.Slice(rep.Placements, func(i, j int) bool { return placementBefore(rep.Placements[i], rep.Placements[j]) })
		rep.Total = len(rep.Placements)
		if q.Continue != "" {
			node, id, _ := strings.Cut(q.Continue, "/")
			after := events.Placement{Node: node, ID: id}
			i := sort.Search(len(rep.Placements), func(i int) bool { return placementBefore(after, rep.Placements[i]) })
			rep.Placements = rep.Placements[i:]
		}
		if q.Limit > 0 && len(rep.Placements) > q.Limit {
			rep.Placements = rep.Placements[:q.Limit]
			last := rep.Placements[q.Limit-1]
			rep.Continue = last.Node + "/" + last.ID
		}
	default:
		return rep, fmt.Errorf("%w: what %q must be images, where or nodes", events.ErrMalformed, q.What)
	}
	return rep, nil
}

// pageImages sorts images (biggest fleet total first) and keeps the page q asks for.
func pageImages(q events.InventoryQuery, images []events.InventoryImage) (events.InventoryReply, error) {
	rep := events.InventoryReply{Images: images}
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	for _, im := range images {
		rep.TotalBytes += im.TotalBytes
	}
	sort.Slice(rep.Images, func(i, j int) bool { return imageBefore(rep.Images[i], rep.Images[j]) })
	rep.Total = len(rep.Images)
	if q.Continue != "" {
		after, err := parseImageContinue(q.Continue)
		if err != nil {
			return rep, err
		}
		i := sort.Search(len(rep.Images), func(i int) bool { return imageBefore(after, rep.Images[i]) })
		rep.Images = rep.Images[i:]
	}
	if q.Limit > 0 && len(rep.Images) > q.Limit {
		rep.Images = rep.Images[:q.Limit]
		last := rep.Images[q.Limit-1]
		rep.Continue = fmt.Sprintf("%d/%s", last.TotalBytes, last.ID)
	}
	if len(rep.Images) == 0 {
		rep.Images = nil
	}
	return rep, nil
}

// pageNodes sorts nodes by name and keeps the page q asks for.
func pageNodes(q events.InventoryQuery, nodes []events.InventoryNode) (events.InventoryReply, error) {
	rep := events.InventoryReply{Nodes: nodes}
	if q.Limit < 0 {
		return rep, fmt.Errorf("%w: limit %d must not be negative", events.ErrMalformed, q.Limit)
	}
	for _, n := range nodes {
		rep.TotalBytes += n.TotalBytes
	}
	sort.Slice(rep.Nodes, func(i, j int) bool { return rep.Nodes[i].Node < rep.Nodes[j].Node })
	rep.Total = len(rep.Nodes)
	if q.Continue != "" {
		i := sort.Search(len(rep.Nodes), func(i int) bool { return rep.Nodes[i].Node > q.Continue })
		rep.Nodes = rep.Nodes[i:]
	}
	if q.Limit > 0 && len(rep.Nodes) > q.Limit {
		rep.Nodes = rep.Nodes[:q.Limit]
		rep.Continue = rep.Nodes[q.Limit-1].Node
	}
	if len(rep.Nodes) == 0 {
		rep.Nodes = nil
	}
	return rep, nil
}

// imageBefore orders images by fleet bytes, biggest first, then by ID.
func imageBefore(a, b events.InventoryImage) bool {
	if a.TotalBytes != b.TotalBytes {
		return a.TotalBytes > b.TotalBytes
	}
	return a.ID < b.ID
}

// placementBefore orders placements by node, then image ID.
func placementBefore(a, b events.Placement) bool {
	if a.Node != b.Node {
		return a.Node < b.Node
	}
	return a.ID < b.ID
}

// parseImageContinue reads an images page's continue token: <total bytes>/<image ID>.
func parseImageContinue(token string) (events.InventoryImage, error) {
	n, id, ok := strings.Cut(token, "/")
	bytes, err := strconv.ParseInt(n, 10, 64)
	if !ok || err != nil || id == "" {
		return events.InventoryImage{}, fmt.Errorf("%w: continue token %q is not one of an images page", events.ErrMalformed, token)
	}
	return events.InventoryImage{TotalBytes: bytes, ID: id}, nil
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
