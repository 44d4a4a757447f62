package records

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Store is the durable copy of one node's image records in events.RecordsBucket: the detector writes it (the
// single writer), the GC executor and the CLI read it.
type Store struct {
	kv   *bus.KV
	node string
}

// OpenStore opens (creating if needed) the records bucket for node.
func OpenStore(ctx context.Context, b *bus.Bus, node string) (*Store, error) {
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: events.RecordsBucket, Description: events.RecordsBucketDescription})
	if err != nil {
		return nil, err
	}
	return &Store{kv: kv, node: node}, nil
}

// Load returns every record of the node, keyed by image ID.
func (s *Store) Load(ctx context.Context) (map[string]events.ImageRecord, error) {
	entries, err := s.kv.List(ctx, events.RecordKeys(s.node))
	if err != nil {
		return nil, fmt.Errorf("load records of %s: %w", s.node, err)
	}
	out := make(map[string]events.ImageRecord, len(entries))
	for _, e := range entries {
		var r events.ImageRecord
		if err := json.Unmarshal(e.Value, &r); err != nil {
			return nil, fmt.Errorf("decode record %s: %w", e.Key, err)
		}
		out[r.ID] = r
	}
	return out, nil
}

// Write stores puts and deletes in one pipelined batch.
func (s *Store) Write(ctx context.Context, puts []events.ImageRecord, deletes []string) error {
	if len(puts) == 0 && len(deletes) == 0 {
		return nil
	}
	p := make(map[string][]byte, len(puts))
	for _, r := range puts {
		raw, err := json.Marshal(r)
		if err != nil {
			return fmt.Errorf("encode record %s: %w", r.ID, err)
		}
		p[s.key(r.ID)] = raw
	}
	d := make([]string, 0, len(deletes))
	for _, id := range deletes {
		d = append(d, s.key(id))
	}
	if err := s.kv.Batch(ctx, p, d); err != nil {
		return fmt.Errorf("write records of %s: %w", s.node, err)
	}
	return nil
}

func (s *Store) key(id string) string { return events.RecordKey(s.node, id) }
