// Compatibility path: node-first inventory keys.
//
// The previous release keyed the inventory bucket node first (events.InventoryNodeFirstKey). A replica of
// this release indexes such a key under its image-first key at once, and re-keys it: the placement is
// copied to its image-first key under the sequence guard, then the node-first key is deleted if unchanged
// since it was read. Keys found by the initial load are re-keyed by one streamed pass over the bucket; keys
// written later by a replica of the previous release still running are queued by the watch (or by the
// range of a partition taken over, inventory_partitions.go) and re-keyed as they come.
//
// Remove when: no bucket holds a node-first key (`fleet where` of every image answers without re-keying)
// and no node-first replica runs (docs/upgrading.md, "Compatibility paths").

package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// legacyEntry is a node-first key to re-key.
type legacyEntry struct {
	key string
	rev uint64
	p   events.Placement
}

// nodeFirstKey is p's key in the previous release's node-first layout.
func nodeFirstKey(p events.Placement) string { return events.InventoryNodeFirstKey(p.Node, p.ID) }

// queueRekey queues node-first key e, holding p, for the re-keyer: one seen after the initial load (by the
// watch, or by the range of a partition taken over).
func (s *Inventory) queueRekey(e bus.Entry, p events.Placement) {
	s.rekeyLive.push(legacyEntry{key: e.Key, rev: e.Revision, p: p})
}

// rekeyWorkers is how many node-first keys a replica re-keys at once.
const rekeyWorkers = 4

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
		if json.Unmarshal(e.Value, &p) != nil || p.Node == "" || p.ID == "" || e.Key != nodeFirstKey(p) {
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

// runRekey re-keys node-first keys once the index is loaded: those found by the initial load (atStart) by
// one pass over the bucket (streamed, not held: at the first start after an upgrade that is every placement
// of the fleet); those written later by a replica of the previous release still running as the watch queues
// them (a few). Neither holds up the watch, events or queries.
func (s *Inventory) runRekey(ctx context.Context, indexed <-chan struct{}, atStart *atomic.Bool) error {
	if !waitLoaded(ctx, indexed) {
		return nil
	}
	if atStart.Load() {
		if err := s.rekeyAll(ctx); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("inventory re-key pass failed; the next start tries again", "err", err)
		}
	}
	for {
		les, ok := s.rekeyLive.wait(ctx)
		if !ok {
			return nil
		}
		for _, le := range les {
			if err := s.rekey(ctx, le); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Warn("inventory re-key failed", "key", le.key, "err", err)
			}
		}
	}
}
