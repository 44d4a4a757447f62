package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// placementKey is the bucket key of image id on node: image first, <image token>.<node token>.
func placementKey(node, id string) string { return events.InventoryKey(id, node) }

// applyCopy applies one image event copied into events.InventoryStream: as Apply, guarded by the event's
// sequence in the events stream (the copy's Nats-Stream-Source header), not the copy's own.
func (s *Inventory) applyCopy(ctx context.Context, m *bus.Msg) error {
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
