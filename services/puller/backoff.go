package puller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// backoffEntry is the state of one backoff key ("<podUID>_<requestedImage>"): the kubelet's
// flowcontrol.Backoff entry plus the previous pull error message it keeps beside it.
type backoffEntry struct {
	Key        string        `json:"key"`
	Backoff    time.Duration `json:"backoff"`
	LastUpdate time.Time     `json:"lastUpdate"`
	// LastError is "<ErrKind>: <message>" of the last failed pull, shown while in backoff.
	LastError string `json:"lastError,omitempty"`
}

// backoffPolicy is the kubelet's image backoff arithmetic: initial 10s, doubling, at most 300s, no jitter;
// an entry idle for more than 2*max is expired (reset on the next failure, never "in backoff").
type backoffPolicy struct{ initial, max time.Duration }

func (p backoffPolicy) expired(e backoffEntry, now time.Time) bool {
	return now.Sub(e.LastUpdate) > 2*p.max
}

// inBackoff is flowcontrol's IsInBackOffSinceUpdate: strictly less than the current window.
func (p backoffPolicy) inBackoff(e backoffEntry, ok bool, now time.Time) bool {
	if !ok || p.expired(e, now) {
		return false
	}
	return now.Sub(e.LastUpdate) < e.Backoff
}

// next is flowcontrol's Next: a new or expired entry starts at initial, else the window doubles up to max.
// The doubling is cenkalti/backoff's ExponentialBackOff with no randomization.
func (p backoffPolicy) next(e backoffEntry, ok bool, now time.Time) backoffEntry {
	if !ok || p.expired(e, now) {
		e.Backoff = p.initial
	} else {
		e.Backoff = p.grow(e.Backoff)
	}
	e.LastUpdate = now
	return e
}

func (p backoffPolicy) grow(cur time.Duration) time.Duration {
	b := &backoff.ExponentialBackOff{
		InitialInterval:     cur,
		RandomizationFactor: 0,
		Multiplier:          2,
		MaxInterval:         p.max,
		MaxElapsedTime:      0,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	b.Reset()
	_ = b.NextBackOff() // cur
	return min(b.NextBackOff(), p.max)
}

// backoffStore keeps backoff entries. The kubelet keeps them in memory (lost on restart); the service keeps
// them in a KV bucket shared by the node's puller replicas.
type backoffStore interface {
	Get(ctx context.Context, key string) (backoffEntry, bool, error)
	Put(ctx context.Context, e backoffEntry) error
	// GC drops entries expired at now (the kubelet's backOff.GC after each successful pull).
	GC(ctx context.Context, now time.Time, p backoffPolicy)
}

// memBackoff is the in-memory store (the kubelet's behaviour; used by tests and when no bus is given).
type memBackoff struct {
	mu sync.Mutex
	m  map[string]backoffEntry
}

func newMemBackoff() *memBackoff { return &memBackoff{m: map[string]backoffEntry{}} }

func (s *memBackoff) Get(_ context.Context, key string) (backoffEntry, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[key]
	return e, ok, nil
}

func (s *memBackoff) Put(_ context.Context, e backoffEntry) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[e.Key] = e
	return nil
}

func (s *memBackoff) GC(_ context.Context, now time.Time, p backoffPolicy) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, e := range s.m {
		if p.expired(e, now) {
			delete(s.m, k)
		}
	}
}

// kvBackoff keeps entries in events.PullBackoffBucket, keyed <node token>.<sha256 of the backoff key>, so
// backoff survives a puller restart and is shared by the node's replicas. The bucket's TTL (longer than 2*max) is the GC: an idle entry is expired anyway.
type kvBackoff struct {
	kv   *bus.KV
	node string
}

func openKVBackoff(ctx context.Context, b *bus.Bus, node string, p backoffPolicy) (*kvBackoff, error) {
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: events.PullBackoffBucket, Description: "image pull backoff per pod and image",
		TTL: 2*p.max + time.Minute})
	if err != nil {
		return nil, err
	}
	return &kvBackoff{kv: kv, node: node}, nil
}

func hashKey(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func (s *kvBackoff) key(k string) string { return events.NodeToken(s.node) + "." + hashKey(k) }

func (s *kvBackoff) Get(ctx context.Context, key string) (backoffEntry, bool, error) {
	v, _, err := s.kv.Get(ctx, s.key(key))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return backoffEntry{}, false, nil
	}
	if err != nil {
		return backoffEntry{}, false, err
	}
	var e backoffEntry
	if err := json.Unmarshal(v, &e); err != nil {
		return backoffEntry{}, false, fmt.Errorf("decode backoff entry: %w", err)
	}
	return e, true, nil
}

func (s *kvBackoff) Put(ctx context.Context, e backoffEntry) error {
	v, err := json.Marshal(e)
	if err != nil {
		return err
	}
	_, err = s.kv.Put(ctx, s.key(e.Key), v)
	return err
}

func (s *kvBackoff) GC(context.Context, time.Time, backoffPolicy) {}
