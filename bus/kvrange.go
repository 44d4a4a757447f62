package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Range calls fn for every live entry whose key matches filter (a NATS subject filter over keys, ">" for all),
// in the bucket's storage order, without holding them: the server filters by key, the caller by anything
// else, and memory stays that of one entry. fn returning false stops the range early. A key rewritten while
// the range runs may come twice, the later entry last (readInitial). A range that reads anything asks once
// for the last revision of the keys it covers.
func (k *KV) Range(ctx context.Context, filter string, fn func(Entry) bool) error {
	if filter == "" {
		filter = ">"
	}
	w, stop, err := k.watcher(ctx, "kv range "+k.kv.Bucket(), filter, kvRetryFor)
	if err != nil {
		return fmt.Errorf("kv range %s/%s: %w", k.kv.Bucket(), filter, err)
	}
	defer stop()
	return readInitial(ctx, w, k.lastRev(filter), func(e jetstream.KeyValueEntry) bool {
		return fn(Entry{Key: e.Key(), Value: e.Value(), Revision: e.Revision(), Created: e.Created()})
	})
}

// readInitial passes a watcher's current entries (puts; deletes skipped) to fn until the bucket has none
// pending, or fn returns false.
//
// Neither nats.go's end-of-initial-values marker nor a message's own pending count (Delta 0) says that on
// its own while the bucket is being written (nats.go v1.55 with nats-server v2.15.2; the repro is
// TestRangeWhileKeysAreRewritten). A key rewritten as the watch begins has its old revision removed
// before it is delivered and its new one appended, and the server's pending count can leave out that new
// one: the range ended one key short. A registry of nodes heartbeating every period missed live nodes that
// way, and a rollout skipped them as Lost. So once nothing is said to be pending, readInitial asks the
// last revision of the keys the watch covers (KV.lastRev) and reads on to it: entries up to that moment
// are all delivered. A rewritten key can come twice; callers keep the later entry.
func readInitial(ctx context.Context, w jetstream.KeyWatcher, lastRev func(context.Context) (uint64, error),
	fn func(jetstream.KeyValueEntry) bool) error {
	got := false     // an entry was read
	var until uint64 // once the pending count ran out: the revision to read to
	for {
		var quiet <-chan time.Time
		if until != 0 {
			// Reading on to until: its entry may have gone meanwhile (expired, purged) with none after it.
			quiet = time.After(rangeQuiet)
		}
		var e jetstream.KeyValueEntry
		var ok bool
		select {
		case <-ctx.Done():
			return ctx.Err()
		case e, ok = <-w.Updates():
		case <-quiet:
			return nil
		}
		switch {
		case !ok:
			return nil
		case e == nil:
			if !got { // nothing was pending when the watch began
				return nil
			}
			continue
		}
		got = true
		if e.Operation() == jetstream.KeyValuePut && !fn(e) {
			return nil
		}
		if until != 0 {
			if e.Revision() >= until {
				return nil
			}
			continue
		}
		if e.Delta() != 0 {
			continue
		}
		last, err := lastRev(ctx)
		if err != nil {
			return err
		}
		if last <= e.Revision() {
			return nil
		}
		until = last
	}
}

// rangeQuiet is how long readInitial waits for the bucket's last revision when nothing arrives: it was
// removed before it could be delivered.
const rangeQuiet = 2 * time.Second

// lastRev returns a func that gives the last revision of the keys matching filter: the bucket's stream's
// last sequence for ">" (one stream info request), else the sequence of the last message on the filter's
// subjects (a stream lookup and a message get; 0 when none). Reading on to the bucket's last revision for a
// filter its last key does not match would wait for an entry that never comes. It is retried for up to
// kvRetryFor with attempts that grow patient, as the watcher's making is: nats.go waits for an answer until
// the caller's deadline.
func (k *KV) lastRev(filter string) func(context.Context) (uint64, error) {
	return func(ctx context.Context) (last uint64, err error) {
		err = k.b.retryPatient(ctx, "kv last revision "+k.kv.Bucket(), kvRetryFor, func(actx context.Context) (err error) {
			last, err = k.lastRevOnce(actx, filter)
			return err
		})
		return last, err
	}
}

// lastRevOnce is one attempt of lastRev.
func (k *KV) lastRevOnce(ctx context.Context, filter string) (uint64, error) {
	if filter == ">" {
		st, err := k.kv.Status(ctx)
		if err != nil {
			return 0, fmt.Errorf("kv %s status: %w", k.kv.Bucket(), err)
		}
		info := streamInfoOf(st)
		if info == nil {
			return 0, fmt.Errorf("kv %s status: no stream info", k.kv.Bucket())
		}
		return info.State.LastSeq, nil
	}
	s, err := k.b.js.Stream(ctx, "KV_"+k.kv.Bucket())
	if err != nil {
		return 0, fmt.Errorf("kv %s stream: %w", k.kv.Bucket(), err)
	}
	m, err := s.GetLastMsgForSubject(ctx, "$KV."+k.kv.Bucket()+"."+filter)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("kv %s last of %s: %w", k.kv.Bucket(), filter, err)
	}
	return m.Sequence, nil
}

// DeleteIf removes key only if its latest revision is still rev (compare and delete); otherwise it returns an
// error wrapping ErrConflict.
func (k *KV) DeleteIf(ctx context.Context, key string, rev uint64) error {
	err := k.kv.Delete(ctx, key, jetstream.LastRevision(rev))
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) || isWrongLastSeq(err) {
			return fmt.Errorf("kv delete %s/%s: %w", k.kv.Bucket(), key, ErrConflict)
		}
		return fmt.Errorf("kv delete %s/%s: %w", k.kv.Bucket(), key, err)
	}
	return nil
}
