package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// InventoryConfig configures a fleet inventory replica.
type InventoryConfig struct {
	// Replica names this replica in logs and query replies (default <hostname>-<pid>).
	Replica string
	// Partitioned consumes the image events through the 16 partition durables on events.InventoryStream
	// (the server's partitioned copy of the image events) instead of the one durable on the events stream
	// shared by every replica (events.InventoryDurable: API, renaming it re-applies the whole stream). Each
	// replica owns a share of the partitions (leases in events.InventoryOwnersBucket, owners.go), consumes
	// and indexes only those, and a query is gathered from every replica's part (inventory_gather.go).
	// Default false: on this project's 2-core machine with three servers both ways caught up at about the
	// same rate uncapped, the cores the limit (docs/runs/2026-11-inventory.md), so the partitions are opt-in
	// until measured on servers with cores of their own.
	Partitioned bool
	// Concurrency is the number of events this replica applies at once (default 32; Partitioned: 256 over
	// the 16 partitions, ceil(256/16) = 16 for each partition it owns: a partition's handlers are also its
	// pull batch, and at 2 each the servers handled 27-29 messages per event instead of 14).
	Concurrency int
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

	// Partitioned (inventory_partitions.go): what this replica has of each partition, a generation bumped at
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
	if cfg.Replica == "" {
		h, _ := os.Hostname()
		cfg.Replica = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// Replicas 0: the connection's Options.Replicas (3 on a 3-server cluster).
	kv, err := b.KV(ctx, inventoryBucket(0))
	if err != nil {
		return nil, fmt.Errorf("inventory: %w", err)
	}
	s := newInventory(cfg)
	s.b, s.kv = b, kv
	if cfg.Partitioned {
		if err := EnsureInventoryStream(ctx, b, 0); err != nil {
			return nil, fmt.Errorf("inventory: %w", err)
		}
		okv, err := b.KV(ctx, ownersBucket(0))
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

// Ready closes once the replica answers queries: its index holds the bucket's initial contents and the
// server holds its subscriptions (queries; partitioned, parts too), so a query sent through the same server
// from then on finds a responder (a cluster's other servers learn of the interest a route round trip later).
// The agent's /healthz waits for it.
func (s *Inventory) Ready() <-chan struct{} { return s.readyCh }
