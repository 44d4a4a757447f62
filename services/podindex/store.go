package podindex

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// snapshotBucket is the KV bucket of pod index snapshots. Keys of a node start with its subject token, so a
// per-node permission on $KV.imagefleet-pods.<node>.> reaches only that node's index:
//
//	<node>.applied      the stream sequence (IMAGEFLEET_EVENTS) of the last pod event the snapshot reflects
//	<node>.pos          the sequence in IMAGEFLEET_PODS of that event, where the tail resumes (absent in a
//	                    snapshot of a release that read IMAGEFLEET_EVENTS: the tail then reads the node's
//	                    pod events of IMAGEFLEET_PODS from its start, skipping those up to <node>.applied)
//	<node>.pod.<uid>    one pod: {"order": <sequence of its last upsert>, "pod": <core/v1 Pod>}
const snapshotBucket = events.PodsBucket

// Store is the durable snapshot of one node's pod index.
type Store struct {
	kv   *bus.KV
	node string
}

// kvOpener opens a KV bucket, creating it if needed (bus.Bus).
type kvOpener interface {
	KV(ctx context.Context, cfg bus.KVConfig) (*bus.KV, error)
}

// OpenStore opens (creating if needed) the snapshot bucket for node.
func OpenStore(ctx context.Context, b kvOpener, node string) (*Store, error) {
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: snapshotBucket, Description: "pod index snapshots per node"})
	if err != nil {
		return nil, err
	}
	return &Store{kv: kv, node: node}, nil
}

func (s *Store) appliedKey() string { return events.NodeToken(s.node) + ".applied" }

func (s *Store) posKey() string { return events.NodeToken(s.node) + ".pos" }

func (s *Store) confirmedKey() string { return events.NodeToken(s.node) + ".confirmed" }

func (s *Store) podKey(uid types.UID) string {
	return events.NodeToken(s.node) + ".pod." + escapeKey(string(uid))
}

// Load reads the snapshot: the pod records and the sequence they reflect (0 and none for a new node).
// The applied sequence is read first: pods written after it are at least as new, which replaying the events
// after it tolerates (see Service).
// The position is read before the applied sequence (it is written after it), so it never runs ahead of it.
// confirmed is the sequence through which the registration events were stored when the last write began
// (0: none written; see State.load).
func (s *Store) load(ctx context.Context) (records [][]byte, applied, pos, confirmed uint64, err error) {
	if pos, err = s.loadPos(ctx); err != nil {
		return nil, 0, 0, 0, err
	}
	if applied, err = s.loadSeq(ctx, s.appliedKey(), "applied sequence"); err != nil {
		return nil, 0, 0, 0, err
	}
	if confirmed, err = s.loadSeq(ctx, s.confirmedKey(), "confirmed sequence"); err != nil {
		return nil, 0, 0, 0, err
	}
	entries, err := s.kv.List(ctx, events.NodeToken(s.node)+".pod.>")
	if err != nil {
		return nil, 0, 0, 0, fmt.Errorf("load pod index of %s: %w", s.node, err)
	}
	records = make([][]byte, 0, len(entries))
	for _, e := range entries {
		records = append(records, e.Value)
	}
	return records, applied, pos, confirmed, nil
}

// loadSeq reads a sequence key (0 when absent).
func (s *Store) loadSeq(ctx context.Context, key, what string) (uint64, error) {
	v, _, err := s.kv.Get(ctx, key)
	switch {
	case errors.Is(err, bus.ErrKeyNotFound):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("load pod index of %s: %w", s.node, err)
	}
	n, err := strconv.ParseUint(string(v), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("load pod index of %s: %s %q: %w", s.node, what, v, err)
	}
	return n, nil
}

// Write stores d: the changed pods first, then the applied sequence.
func (s *Store) write(ctx context.Context, d snapshotDelta) error {
	puts := make(map[string][]byte, len(d.Puts))
	for _, r := range d.Puts {
		b, err := r.Encode()
		if err != nil {
			return fmt.Errorf("write pod index of %s: %w", s.node, err)
		}
		puts[s.podKey(r.UID)] = b
	}
	dels := make([]string, 0, len(d.Deletes))
	for _, uid := range d.Deletes {
		dels = append(dels, s.podKey(uid))
	}
	if len(puts)+len(dels) > 0 {
		// The flush confirmed every registration event through d.Applied before this write: said first, so
		// that a write stopped part way is replayed quietly up to it (State.load).
		if _, err := s.kv.Put(ctx, s.confirmedKey(), []byte(strconv.FormatUint(d.Applied, 10))); err != nil {
			return fmt.Errorf("write pod index of %s: %w", s.node, err)
		}
		if err := s.kv.Batch(ctx, puts, dels); err != nil {
			return fmt.Errorf("write pod index of %s: %w", s.node, err)
		}
	}
	if _, err := s.kv.Put(ctx, s.appliedKey(), []byte(strconv.FormatUint(d.Applied, 10))); err != nil {
		return fmt.Errorf("write pod index of %s: %w", s.node, err)
	}
	if d.Pos > 0 {
		if _, err := s.kv.Put(ctx, s.posKey(), []byte(strconv.FormatUint(d.Pos, 10))); err != nil {
			return fmt.Errorf("write pod index of %s: %w", s.node, err)
		}
	}
	return nil
}

// escapeKey turns a UID into one KV key token: bytes outside [-_a-zA-Z0-9] become =XX (hex).
func escapeKey(id string) string {
	clean := true
	for i := 0; i < len(id); i++ {
		if !keyByte(id[i]) {
			clean = false
			break
		}
	}
	if clean && id != "" {
		return id
	}
	var b strings.Builder
	for i := 0; i < len(id); i++ {
		c := id[i]
		if keyByte(c) {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "=%02X", c)
	}
	if b.Len() == 0 {
		return "=" // an empty UID never reaches the store (the decoder rejects it)
	}
	return b.String()
}

func keyByte(c byte) bool {
	return c == '-' || c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
}
