package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// The partitioned inventory (InventoryConfig.Partitioned). Each replica owns a set of the 16 partitions
// (owners.go), consumes only their durables, and indexes only their placements: an entry of the bucket's
// watch whose node is in another replica's partition costs a hash of its key's node token, not a decode.
// A query on events.InventoryQuerySubject goes, as before, to one replica of the queue group; that replica
// asks every replica for its part (events.InventoryPartsSubject), waits until the parts cover all 16
// partitions, and merges them, so clients are unchanged.

// partState is what a replica has of one partition.
type partState uint8

const (
	partNone    partState = iota // another replica's (or nobody's)
	partLoading                  // owned; its placements are being read from the bucket
	partReady                    // owned, indexed, consumed, answered for
)

// imageTokenShape reports whether an inventory key's first token is an image token of a sha256 ID or a
// hashed one (events.InventoryImageToken): an image-first key, whose second token is the node's.
func imageTokenShape(tok string) bool {
	for _, prefix := range []string{"sha256_", "h_"} {
		if rest, ok := strings.CutPrefix(tok, prefix); ok && len(rest) == 64 && isHex(rest) {
			return true
		}
	}
	return false
}

// keyPartition is the partition of an inventory key's node told from the key alone, or -1 when the key
// does not say (not image first by its shape: a node-first key of the previous release, or an image ID
// that is not a sha256 digest; those are decoded).
func keyPartition(key string) int {
	img, node, ok := strings.Cut(key, ".")
	if !ok || strings.Contains(node, ".") || !imageTokenShape(img) {
		return -1
	}
	return events.InventoryTokenPartition(node)
}

// foreignKey reports whether an entry of key belongs to a partition this replica has nothing of (s.mu
// held), told from the key alone.
func (s *Inventory) foreignKey(key string) bool {
	if !s.cfg.Partitioned {
		return false
	}
	p := keyPartition(key)
	return p >= 0 && s.own[p] == partNone
}

// ownsNode reports whether node's partition is one this replica has (loading or ready; s.mu held).
func (s *Inventory) ownsNode(node string) bool {
	return !s.cfg.Partitioned || s.own[events.InventoryPartition(node)] != partNone
}

// partitionsChanged is the owners' report: released partitions are no longer consumed, indexed or
// answered for; acquired ones are read from the bucket (by the initial watch if it has not started yet,
// else by a range of their own), then consumed and answered for.
func (s *Inventory) partitionsChanged(acquired, released []int) {
	s.mu.Lock()
	for _, p := range released {
		s.own[p] = partNone
		s.gen[p]++
		s.viaWatch[p] = false
	}
	if len(released) > 0 {
		s.dropPartitions(released)
	}
	var toLoad []int
	for _, p := range acquired {
		s.own[p] = partLoading
		s.gen[p]++
		if s.watching {
			toLoad = append(toLoad, p)
		} else {
			s.viaWatch[p] = true
		}
	}
	gens := s.gen
	s.mu.Unlock()
	for _, p := range released {
		s.stopConsumer(p)
	}
	if len(acquired)+len(released) > 0 {
		s.cfg.Logger.Info("inventory partitions changed", "replica", s.cfg.Replica, "acquired", acquired, "released", released)
	}
	if len(toLoad) > 0 {
		s.spawn(func() { s.loadPartitions(toLoad, gens) })
	}
}

// dropPartitions removes the placements of ps from the index (s.mu held).
func (s *Inventory) dropPartitions(ps []int) {
	gone := map[int]bool{}
	for _, p := range ps {
		gone[p] = true
	}
	for img, nodes := range s.index {
		for node, cur := range nodes {
			if gone[events.InventoryTokenPartition(node)] {
				s.unref(cur.Placement)
				delete(nodes, node)
			}
		}
		if len(nodes) == 0 {
			delete(s.index, img)
		}
	}
}

// initialLoaded marks the partitions the initial watch loaded ready and returns them, to consume (s.mu held).
func (s *Inventory) initialLoaded() []int {
	var ready []int
	for p := range events.InventoryPartitions {
		if s.viaWatch[p] && s.own[p] == partLoading {
			s.own[p] = partReady
			ready = append(ready, p)
		}
		s.viaWatch[p] = false
	}
	return ready
}

// loadPartitions reads the placements of partitions ps from the bucket (taken over after the initial
// load), then makes them ready. A partition released or taken again meanwhile (its generation moved on) is
// left to what changed it.
func (s *Inventory) loadPartitions(ps []int, gens [events.InventoryPartitions]uint64) {
	ctx := s.runCtx
	want := map[int]bool{}
	for _, p := range ps {
		want[p] = true
	}
	start := time.Now()
	wait := time.Second
	for {
		err := s.kv.Range(ctx, ">", func(e bus.Entry) bool {
			if kp := keyPartition(e.Key); kp >= 0 && !want[kp] {
				return true
			}
			var p events.Placement
			if json.Unmarshal(e.Value, &p) != nil || p.Node == "" || p.ID == "" {
				return true
			}
			pp := events.InventoryPartition(p.Node)
			if !want[pp] {
				return true
			}
			s.mu.Lock()
			legacy := false
			if s.gen[pp] == gens[pp] {
				_, legacy = s.indexPlacement(e.Key, p, e.Revision)
			}
			s.mu.Unlock()
			if legacy {
				// A node-first key written after this replica's start by a replica of the previous release:
				// the watch passed it over (not this replica's partition then), and the owner that would
				// have re-keyed it is gone.
				s.queueRekey(e, p)
			}
			return true
		})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		// Until it is read, the partition stays unanswered (queries are refused with ErrPartsMissing).
		s.cfg.Logger.Warn("inventory: reading taken-over partitions failed; trying again", "partitions", ps, "in", wait, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 10*time.Second)
	}
	var ready []int
	s.mu.Lock()
	for _, p := range ps {
		if s.gen[p] == gens[p] && s.own[p] == partLoading {
			s.own[p] = partReady
			ready = append(ready, p)
		}
	}
	s.mu.Unlock()
	s.cfg.Logger.Info("inventory partitions loaded", "replica", s.cfg.Replica, "partitions", ready, "took", time.Since(start).Round(time.Millisecond))
	for _, p := range ready {
		s.startConsumer(p)
	}
}

// spawn runs f in a goroutine Run waits for, unless Run is ending.
func (s *Inventory) spawn(f func()) bool {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if s.stopped {
		return false
	}
	s.cwg.Add(1)
	go func() {
		defer s.cwg.Done()
		f()
	}()
	return true
}

// startConsumer consumes partition p's durable until stopConsumer or the run's end.
func (s *Inventory) startConsumer(p int) {
	s.cmu.Lock()
	if s.consumers[p] != nil || s.runCtx.Err() != nil || s.stopped {
		s.cmu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(s.runCtx)
	s.consumers[p] = cancel
	s.cmu.Unlock()
	per := (s.cfg.Concurrency + events.InventoryPartitions - 1) / events.InventoryPartitions
	s.spawn(func() {
		err := s.b.Consume(ctx, bus.ConsumerConfig{Stream: events.InventoryStream,
			Durable: events.InventoryPartitionDurable(p), FilterSubjects: []string{events.InventoryPartitionFilter(p)},
			MaxAckPending: inventoryPartitionMaxAckPending, Concurrency: per, MaxDeliver: 10, Backoff: inventoryBackoff,
			AckWait: inventoryAckWait, AsyncAck: true, StallAfter: inventoryStallAfter}, s.applyCopy)
		if err != nil && ctx.Err() == nil {
			select {
			case s.fail <- fmt.Errorf("consume partition %d: %w", p, err):
			default:
			}
		}
	})
}

func (s *Inventory) stopConsumer(p int) {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if cancel := s.consumers[p]; cancel != nil {
		cancel()
		s.consumers[p] = nil
	}
}

// Owned returns the partitions this replica answers for (partitioned; nil otherwise): none until it is
// Ready, since a partition taken over while the initial load runs is ready before the replica listens for
// parts.
func (s *Inventory) Owned() []int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.ready {
		return nil
	}
	var out []int
	for p, st := range s.own {
		if st == partReady {
			out = append(out, p)
		}
	}
	return out
}
