package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrKeyNotFound is returned by KV.Get for a missing key.
var ErrKeyNotFound = errors.New("key not found")

// KVConfig configures a bucket.
type KVConfig struct {
	Bucket      string
	Description string
	// TTL expires values not updated for this long (0: never).
	TTL      time.Duration
	History  uint8
	Replicas int
	MaxBytes int64
}

// KV is a JetStream key-value bucket.
type KV struct {
	b  *Bus
	kv jetstream.KeyValue
	// ttl is the bucket's TTL as KV found or made it; ttlKnown is false when KV could not tell (a bucket
	// another client made at the same moment, or one KVExisting opened).
	ttl      time.Duration
	ttlKnown bool
}

// TTL is the bucket's TTL (0: values never expire) as KV found or made it; false when not known.
func (k *KV) TTL() (time.Duration, bool) { return k.ttl, k.ttlKnown }

// KV opens the bucket, creating it if it does not exist (idempotent), and returns it. An existing bucket
// whose settings differ is updated when the identity may; otherwise it is used as it is (a node identity
// may not change buckets: the operator made them).
func (b *Bus) KV(ctx context.Context, cfg KVConfig) (*KV, error) {
	kvc := jetstream.KeyValueConfig{
		Bucket: cfg.Bucket, Description: cfg.Description, TTL: cfg.TTL, History: max(cfg.History, 1),
		Storage: jetstream.FileStorage, Replicas: cfg.Replicas, MaxBytes: cfg.MaxBytes,
	}
	if kvc.Replicas == 0 {
		kvc.Replicas = b.replicas
	}
	if cfg.MaxBytes == 0 {
		kvc.MaxBytes = -1
	}
	var out *KV
	err := b.retryTransient(ctx, "bucket "+cfg.Bucket, func(actx context.Context) (err error) {
		out, err = b.openKV(actx, cfg, kvc)
		return err
	})
	return out, err
}

func (b *Bus) openKV(ctx context.Context, cfg KVConfig, kvc jetstream.KeyValueConfig) (*KV, error) {
	kv, err := b.js.KeyValue(ctx, cfg.Bucket)
	switch {
	case err == nil:
		matches, haveTTL, sErr := bucketMatches(ctx, kv, &kvc)
		if sErr != nil {
			// Not a mismatch: a status that timed out (a busy cluster) is retried as a transient error,
			// instead of an update that is one more API request per node and would fail the same way.
			return nil, fmt.Errorf("key-value bucket %s status: %w", cfg.Bucket, sErr)
		}
		if matches {
			return &KV{b: b, kv: kv, ttl: haveTTL, ttlKnown: true}, nil
		}
		var updated jetstream.KeyValue
		err := b.refusable(ctx, b.apiPrefix("KV_"+cfg.Bucket)+"STREAM.UPDATE.KV_"+cfg.Bucket, func(ctx context.Context) (err error) {
			updated, err = b.js.UpdateKeyValue(ctx, kvc)
			return err
		})
		if err != nil {
			b.log.Warn("bucket kept with its existing settings", "bucket", cfg.Bucket, "err", err)
			return &KV{b: b, kv: kv, ttl: haveTTL, ttlKnown: true}, nil
		}
		return &KV{b: b, kv: updated, ttl: kvc.TTL, ttlKnown: true}, nil
	case errors.Is(err, jetstream.ErrBucketNotFound):
		kvc.Replicas = max(kvc.Replicas, 1)
		err = b.refusable(ctx, b.apiPrefix("KV_"+cfg.Bucket)+"STREAM.CREATE.KV_"+cfg.Bucket, func(ctx context.Context) (err error) {
			kv, err = b.js.CreateKeyValue(ctx, kvc)
			return err
		})
		made := err == nil
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = b.js.KeyValue(ctx, cfg.Bucket)
		}
		if err != nil {
			return nil, fmt.Errorf("create key-value bucket %s (an operator with the admin identity creates buckets: imagefleet bus init): %w", cfg.Bucket, err)
		}
		if err := b.RaiseBucketConsumers(ctx, cfg.Bucket); err != nil {
			b.log.Warn("bucket kept at the server's consumer limit", "bucket", cfg.Bucket, "err", err)
		}
		out := &KV{b: b, kv: kv, ttl: kvc.TTL, ttlKnown: made}
		if !made {
			// Another client made it first, perhaps with another TTL: ask (a failed read leaves it unknown).
			if st, err := kv.Status(ctx); err == nil {
				out.ttl, out.ttlKnown = st.TTL(), true
			}
		}
		return out, nil
	default:
		return nil, fmt.Errorf("key-value bucket %s: %w", cfg.Bucket, err)
	}
}

// bucketMatches reports whether an open bucket has the settings KV would give it, and the TTL it has.
// Unspecified replicas (0) take the bucket's own. A status that cannot be read is an error, never a mismatch.
func bucketMatches(ctx context.Context, kv jetstream.KeyValue, want *jetstream.KeyValueConfig) (bool, time.Duration, error) {
	st, err := kv.Status(ctx)
	if err != nil {
		return false, 0, err
	}
	info := streamInfoOf(st)
	if info == nil {
		return false, st.TTL(), nil
	}
	have := info.Config
	if want.Replicas == 0 {
		want.Replicas = have.Replicas
	}
	return have.MaxAge == want.TTL && have.MaxMsgsPerSubject == int64(want.History) &&
		have.Replicas == want.Replicas && have.MaxBytes == want.MaxBytes, have.MaxAge, nil
}

// streamInfoOf is the stream info a bucket's status carries (nil when it has none).
func streamInfoOf(st jetstream.KeyValueStatus) *jetstream.StreamInfo {
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
		return bs.StreamInfo()
	}
	return nil
}

// Get returns the value and revision of key, or ErrKeyNotFound.
func (k *KV) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	var e jetstream.KeyValueEntry
	err := k.b.retryTransientFor(ctx, "kv get "+k.kv.Bucket(), kvRetryFor, func(actx context.Context) (err error) {
		e, err = k.kv.Get(actx, key)
		return err
	})
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil, 0, ErrKeyNotFound
		}
		return nil, 0, fmt.Errorf("kv get %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return e.Value(), e.Revision(), nil
}

// Put stores value under key.
func (k *KV) Put(ctx context.Context, key string, value []byte) (uint64, error) {
	var rev uint64
	err := k.b.retryTransientFor(ctx, "kv put "+k.kv.Bucket(), kvRetryFor, func(actx context.Context) (err error) {
		rev, err = k.kv.Put(actx, key, value)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("kv put %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return rev, nil
}

// Delete removes key (a missing key is not an error).
func (k *KV) Delete(ctx context.Context, key string) error {
	err := k.b.retryTransientFor(ctx, "kv delete "+k.kv.Bucket(), kvRetryFor, func(actx context.Context) error { return k.kv.Delete(actx, key) })
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("kv delete %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return nil
}

// Batch writes many puts and deletes pipelined (async publish to the bucket's subjects) and waits for every
// ack: one round trip instead of one per key.
func (k *KV) Batch(ctx context.Context, puts map[string][]byte, deletes []string) error {
	_, err := k.BatchRevisions(ctx, puts, deletes)
	return err
}

// BatchRevisions is Batch, and returns each written key's new revision. When some writes fail (or cannot be
// sent) it returns the first failure with the revisions of the writes the server acked (ctx ending: those
// acked so far), so a caller can act on what was written.
func (k *KV) BatchRevisions(ctx context.Context, puts map[string][]byte, deletes []string) (map[string]uint64, error) {
	futures := make([]jetstream.PubAckFuture, 0, len(puts)+len(deletes))
	keys := make([]string, 0, len(puts)+len(deletes))
	prefix := k.b.kvPutPrefix(k.kv.Bucket())
	var failed error // the first failure; the writes already sent are still waited for
	for key, v := range puts {
		f, err := k.b.js.PublishAsync(prefix+key, v)
		if err != nil {
			failed = fmt.Errorf("kv batch put %s/%s: %w", k.kv.Bucket(), key, err)
			break
		}
		futures, keys = append(futures, f), append(keys, key)
	}
	for _, key := range deletes {
		if failed != nil {
			break
		}
		m := nats.NewMsg(prefix + key)
		m.Header.Set("KV-Operation", "DEL")
		f, err := k.b.js.PublishMsgAsync(m)
		if err != nil {
			failed = fmt.Errorf("kv batch delete %s/%s: %w", k.kv.Bucket(), key, err)
			break
		}
		futures, keys = append(futures, f), append(keys, key)
	}
	revs := make(map[string]uint64, len(keys))
	for i, f := range futures {
		select {
		case ack := <-f.Ok():
			revs[keys[i]] = ack.Sequence
		case err := <-f.Err():
			if failed == nil {
				failed = fmt.Errorf("publish %s: %w", f.Msg().Subject, err)
			}
		case <-ctx.Done():
			return revs, ctx.Err()
		}
	}
	return revs, failed
}

// Entry is one key's value.
type Entry struct {
	Key      string
	Value    []byte
	Revision uint64
	Created  time.Time
	Deleted  bool
}

// List returns every live entry whose key matches filter (a NATS subject filter over keys, ">" for all).
func (k *KV) List(ctx context.Context, filter string) ([]Entry, error) {
	if filter == "" {
		filter = ">"
	}
	w, stop, err := k.watcher(ctx, "kv list "+k.kv.Bucket(), filter, kvRetryFor)
	if err != nil {
		return nil, fmt.Errorf("kv list %s/%s: %w", k.kv.Bucket(), filter, err)
	}
	defer stop()
	// A key rewritten while the bucket streams by comes twice (readInitial): its later entry replaces the
	// first, where the first was.
	var out []Entry
	at := map[string]int{}
	err = readInitial(ctx, w, k.lastRev(filter), func(e jetstream.KeyValueEntry) bool {
		en := Entry{Key: e.Key(), Value: e.Value(), Revision: e.Revision(), Created: e.Created()}
		if i, ok := at[en.Key]; ok {
			out[i] = en
			return true
		}
		at[en.Key] = len(out)
		out = append(out, en)
		return true
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// watcher opens a watcher of the keys matching filter, which lasts until ctx ends or stop is called. Each
// attempt to make its consumer ends with the attempt, and one that fails transiently is made again
// (retryPatient: from AttemptTimeout, more patient after each attempt that timed out; for maxElapsed, 0:
// while ctx lasts).
//
// nats.go makes a watcher's consumer under the context the watcher then lives by, so a caller's deadline (a
// command's --timeout) bounded the create request too: a request a loaded server dropped (its JetStream API
// queue, once over its limit, drops every request it holds) or whose answer was lost held the caller until
// that deadline, and `fleet nodes` ended with "kv range imagefleet-nodes-seen/>: context deadline exceeded"
// (TestRangeMakesALostWatcherAgain). So the watcher lives by a context that ends with ctx but has no
// deadline, and nats.go's create request sees the attempt's (createWait), which cancels it when it passes.
func (k *KV) watcher(ctx context.Context, what, filter string, maxElapsed time.Duration) (jetstream.KeyWatcher, func(), error) {
	var (
		w    jetstream.KeyWatcher
		stop func()
	)
	err := k.b.retryPatient(ctx, what, maxElapsed, func(actx context.Context) error {
		life, cancel := context.WithCancel(context.WithoutCancel(ctx))
		unlink := context.AfterFunc(ctx, cancel)
		abort := context.AfterFunc(actx, cancel)
		deadline, _ := actx.Deadline()
		kw, err := k.kv.Watch(createWait{Context: life, deadline: deadline}, filter)
		if !abort() {
			// The attempt ended (or ctx) before the watcher was made: it is cancelled, or being cancelled.
			if err == nil {
				_ = kw.Stop()
			}
			unlink()
			cancel()
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("make the watcher's consumer: %w", context.DeadlineExceeded)
		}
		if err != nil {
			unlink()
			cancel()
			return err
		}
		w = kw
		stop = func() {
			_ = kw.Stop()
			unlink()
			cancel()
		}
		return nil
	})
	return w, stop, err
}

// createWait is a watcher's context as nats.go's create request sees it: it says it ends at the attempt's
// deadline, so the request waits for that (the cancel of Context when the attempt ends) rather than nats.go's
// own 5 s for a context without one; the watcher made lives on by Context, which has no deadline. nats.go
// reads the deadline only to time the create request (getJSContextOpts).
type createWait struct {
	context.Context
	deadline time.Time
}

func (c createWait) Deadline() (time.Time, bool) { return c.deadline, true }

// Watch calls fn for every current entry, then the marker (fn with Entry{} and initialDone true), then each
// change until ctx ends. Deleted keys arrive with Deleted set.
//
// The marker comes once every entry written before the watch began has been passed on. nats.go's own marker
// can come one key early while the bucket is being written (readInitial says why), so at it Watch asks the
// last revision of the keys it covers (KV.lastRev) and holds the marker until an entry at or past that
// revision has been passed on, or nothing came for rangeQuiet (that entry was removed before it could be
// delivered). Changes are passed on meanwhile as they come; only the marker waits. If the last revision
// cannot be read, the marker comes at once, as nats.go gave it.
func (k *KV) Watch(ctx context.Context, filter string, fn func(e Entry, initialDone bool)) error {
	if filter == "" {
		filter = ">"
	}
	// A watch lasts as long as its worker: its start waits out a cluster electing leaders.
	w, stop, err := k.watcher(ctx, "kv watch "+k.kv.Bucket(), filter, 0)
	if err != nil {
		return fmt.Errorf("kv watch %s/%s: %w", k.kv.Bucket(), filter, err)
	}
	defer stop()
	lastRev := k.lastRev(filter)
	var (
		seen   uint64 // the highest revision passed on
		until  uint64 // while the marker is held: the revision to pass on first
		quiet  <-chan time.Time
		marked bool // the marker was passed on
	)
	mark := func() { marked, until, quiet = true, 0, nil; fn(Entry{}, true) }
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-quiet:
			mark()
		case e, ok := <-w.Updates():
			if !ok {
				return nil
			}
			if e == nil {
				if marked || until != 0 {
					continue
				}
				last, err := lastRev(ctx)
				if err != nil {
					k.b.log.Warn("kv watch: passing the initial-values marker on unchecked", "bucket", k.kv.Bucket(), "filter", filter, "err", err)
				}
				if err != nil || last <= seen {
					mark()
					continue
				}
				until, quiet = last, time.After(rangeQuiet)
				continue
			}
			fn(Entry{Key: e.Key(), Value: e.Value(), Revision: e.Revision(), Created: e.Created(),
				Deleted: e.Operation() != jetstream.KeyValuePut}, false)
			seen = max(seen, e.Revision())
			if until != 0 && seen >= until {
				mark()
			}
		}
	}
}

// ErrConflict is returned by KV.Create when the key exists, by KV.Update when the key changed since the
// given revision, and wrapped by nothing else.
var ErrConflict = errors.New("conflict")

func isWrongLastSeq(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

// Create stores value under key only if the key does not exist (or was deleted); otherwise it returns an
// error wrapping ErrConflict.
func (k *KV) Create(ctx context.Context, key string, value []byte) (uint64, error) {
	rev, err := k.kv.Create(ctx, key, value)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) || isWrongLastSeq(err) {
			return 0, fmt.Errorf("kv create %s/%s: %w", k.kv.Bucket(), key, ErrConflict)
		}
		return 0, fmt.Errorf("kv create %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return rev, nil
}

// Update stores value under key only if the key's latest revision is rev (compare and set); otherwise it
// returns an error wrapping ErrConflict.
func (k *KV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	nrev, err := k.kv.Update(ctx, key, value, rev)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) || isWrongLastSeq(err) {
			return 0, fmt.Errorf("kv update %s/%s: %w", k.kv.Bucket(), key, ErrConflict)
		}
		return 0, fmt.Errorf("kv update %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return nrev, nil
}

// ErrBucketNotFound is returned by KVExisting when the bucket does not exist.
var ErrBucketNotFound = errors.New("bucket not found")

// KVExisting opens a bucket without creating or changing it (a reader must not reset the writer's TTL).
func (b *Bus) KVExisting(ctx context.Context, bucket string) (*KV, error) {
	kv, err := b.js.KeyValue(ctx, bucket)
	if err != nil {
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return nil, fmt.Errorf("key-value bucket %s: %w", bucket, ErrBucketNotFound)
		}
		return nil, fmt.Errorf("key-value bucket %s: %w", bucket, err)
	}
	return &KV{b: b, kv: kv}, nil
}
