package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// GetKey reads one key's last value with a single direct get on the key's own subject
// ($JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>), without opening the bucket: no stream info request,
// no consumer. It is for a reader whose permissions name that subject and nothing else of the bucket (a node
// reading its own key). A deleted or purged key comes back with Deleted set and its revision; a key never
// written is ErrKeyNotFound. Any replica may answer, so a value written a moment ago can come back older:
// a caller that was told of a revision compares it (KeyFollower does).
func (b *Bus) GetKey(ctx context.Context, bucket, key string) (Entry, error) {
	stream := "KV_" + bucket
	subject := b.apiPrefix(stream) + "DIRECT.GET." + stream + ".$KV." + bucket + "." + key
	var e Entry
	err := b.retryTransientFor(ctx, "kv get "+bucket, kvRetryFor, func(actx context.Context) error {
		m, err := b.nc.RequestMsgWithContext(actx, &nats.Msg{Subject: subject})
		if err != nil {
			if errors.Is(err, nats.ErrNoResponders) {
				// No replica of the bucket's stream answers: the bucket does not exist, or none is up.
				return fmt.Errorf("%w (or no replica of it answers)", ErrBucketNotFound)
			}
			return err
		}
		e, err = directGetEntry(key, m)
		return err
	})
	if err != nil {
		if errors.Is(err, ErrKeyNotFound) {
			return Entry{}, ErrKeyNotFound
		}
		return Entry{}, fmt.Errorf("kv get %s/%s: %w", bucket, key, err)
	}
	return e, nil
}

// directGetEntry decodes a direct get's answer: the stored message with the stream's headers, or a status.
func directGetEntry(key string, m *nats.Msg) (Entry, error) {
	if status := m.Header.Get("Status"); status != "" {
		if status == "404" {
			return Entry{}, ErrKeyNotFound
		}
		return Entry{}, fmt.Errorf("direct get: status %s %s", status, m.Header.Get("Description"))
	}
	seq, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
	if err != nil {
		return Entry{}, fmt.Errorf("direct get: sequence header %q: %w", m.Header.Get(jetstream.SequenceHeader), err)
	}
	e := Entry{Key: key, Value: m.Data, Revision: seq}
	if ts := m.Header.Get(jetstream.TimeStampHeaer); ts != "" {
		e.Created, _ = time.Parse(time.RFC3339Nano, ts)
	}
	switch m.Header.Get("KV-Operation") {
	case "DEL", "PURGE":
		e.Deleted, e.Value = true, nil
	}
	return e, nil
}

// KeyFollowerConfig configures FollowKey.
type KeyFollowerConfig struct {
	// Bucket and Key name the followed key.
	Bucket, Key string
	// Notices is the core subject on which the key's writer announces each write's revision (a JSON
	// number, after the write is stored); "" follows by Resync alone.
	Notices string
	// Resync is how often the key is read whatever was announced (a notice lost with a connection);
	// each wait is drawn between Resync/2 and 3*Resync/2 so a fleet's readers do not come at once.
	Resync time.Duration
	// Retry is the first wait after a failed read, doubling up to 30 s.
	Retry time.Duration
}

// FollowKey calls fn with the key's value as it changes, until ctx ends, without a consumer: one direct get
// at the start, after each notice, after each reconnection and every Resync, and fn only when the revision
// read is new. A read older than what is known (the revision held, or one a notice named: any replica
// answers a direct get, a follower catching up too) is made again, Retry doubling, and taken only after
// maxBehind such reads in a row (the bucket made again), so a lagging replica never takes the follower back
// to an older value nor drops the one it holds. A core subscription to the writer's notices makes a change arrive within a round trip. The
// first call comes after the first read that succeeded, with found false when the key does not exist (or
// was deleted: e.Deleted). A read that fails is tried again (Retry, doubling) and fn is not called: what the
// caller holds stays in force. Compared with a key-value watch, it costs the servers no consumer per
// reader, which at 10,000 readers was the difference between a fleet that starts and one that does not
// (docs/scale.md).
func (b *Bus) FollowKey(ctx context.Context, cfg KeyFollowerConfig, fn func(e Entry, found bool)) error {
	if cfg.Resync <= 0 {
		cfg.Resync = 5 * time.Minute
	}
	if cfg.Retry <= 0 {
		cfg.Retry = time.Second
	}
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	var (
		mu       sync.Mutex
		announce uint64 // the highest revision a notice announced
	)
	if cfg.Notices != "" {
		sub, err := b.nc.Subscribe(cfg.Notices, func(m *nats.Msg) {
			if refuseDelivered(b.log, m) {
				return
			}
			rev, err := strconv.ParseUint(string(m.Data), 10, 64)
			if err != nil {
				b.log.Warn("kv key notice unreadable, reading the key", "subject", m.Subject, "err", err)
			}
			mu.Lock()
			announce = max(announce, rev)
			mu.Unlock()
			poke()
		})
		if err != nil {
			return fmt.Errorf("follow %s/%s: subscribe %s: %w", cfg.Bucket, cfg.Key, cfg.Notices, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
		// The first read comes after the server holds the interest, so no write falls between the two. A
		// flush that fails (a loaded server) delays nothing: the subscription stands, and Resync covers it.
		fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := b.nc.FlushWithContext(fctx); err != nil && ctx.Err() == nil {
			b.log.Debug("kv key notices: flush failed, following on", "subject", cfg.Notices, "err", err)
		}
		cancel()
	}
	stop := b.OnReconnect(poke)
	defer stop()

	var (
		have   uint64 // the revision last passed to fn
		called bool
		wait   = cfg.Retry
		behind int // reads in a row older than what is known
		timer  = time.NewTimer(0)
	)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		case <-timer.C:
		}
		mu.Lock()
		want := max(announce, have)
		mu.Unlock()
		e, err := b.GetKey(ctx, cfg.Bucket, cfg.Key)
		found := err == nil && !e.Deleted
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && !errors.Is(err, ErrKeyNotFound):
			level := slog.LevelWarn
			if errors.Is(err, ErrBucketNotFound) && wait < maxFollowWait {
				// Not made yet (bus init, or its writer, makes it), or its stream electing a leader: a
				// warning once the reads are as far apart as they get (no replica answers for long).
				level = slog.LevelDebug
			}
			b.log.Log(ctx, level, "kv key read failed, what is held stays in force", "bucket", cfg.Bucket, "key", cfg.Key, "err", err, "retry_in", wait)
			resetTimer(timer, wait)
			wait = min(2*wait, maxFollowWait)
			continue
		case e.Revision < want && behind < maxBehind:
			// Older than a notice told of, or than what is held (a missing key included): a replica
			// behind the writes (any replica answers a direct get, a follower catching up too). Read
			// again, sooner at first, never going back meanwhile. After maxBehind such reads in a row
			// the answer stands: the bucket was made again, or a notice named a revision it never had.
			behind++
			b.log.Debug("kv key read behind what is known, reading again", "bucket", cfg.Bucket, "key", cfg.Key,
				"revision", e.Revision, "known", want, "retry_in", wait)
			resetTimer(timer, wait)
			wait = min(2*wait, maxFollowWait)
			continue
		case e.Revision < want:
			b.log.Warn("kv key read behind what is known after several reads, taking it", "bucket", cfg.Bucket, "key", cfg.Key,
				"revision", e.Revision, "known", want, "reads", behind+1)
			mu.Lock()
			announce = 0
			mu.Unlock()
		}
		wait, behind = cfg.Retry, 0
		if !called || e.Revision != have {
			called, have = true, e.Revision
			fn(e, found)
		}
		resetTimer(timer, jitter(cfg.Resync))
	}
}

// maxBehind is how many reads in a row older than what a follower knows it makes before it takes the
// answer: with Retry's doubling from 1 s, about a minute of a replica behind.
const maxBehind = 6

// jitter returns a duration drawn between d/2 and 3d/2.
func jitter(d time.Duration) time.Duration { return d/2 + rand.N(d) }

func resetTimer(t *time.Timer, d time.Duration) {
	t.Stop()
	select {
	case <-t.C:
	default:
	}
	t.Reset(d)
}

// OnReconnect calls f after each reconnection of b's connection (on the connection's callback goroutine:
// f must not block) until the returned function is called.
func (b *Bus) OnReconnect(f func()) (stop func()) {
	b.reconnectMu.Lock()
	defer b.reconnectMu.Unlock()
	b.reconnectSeq++
	id := b.reconnectSeq
	if b.reconnectFns == nil {
		b.reconnectFns = map[uint64]func(){}
	}
	b.reconnectFns[id] = f
	return func() {
		b.reconnectMu.Lock()
		defer b.reconnectMu.Unlock()
		delete(b.reconnectFns, id)
	}
}

// callReconnectFns runs the OnReconnect callbacks.
func (b *Bus) callReconnectFns() {
	b.reconnectMu.Lock()
	fns := make([]func(), 0, len(b.reconnectFns))
	for _, f := range b.reconnectFns {
		fns = append(fns, f)
	}
	b.reconnectMu.Unlock()
	for _, f := range fns {
		f()
	}
}

// AnnounceRevision publishes rev on subject (a core publish, not stored): what a key's writer sends, after
// the write is stored, to the readers that FollowKey with that subject as Notices.
func (b *Bus) AnnounceRevision(subject string, rev uint64) error {
	if err := b.nc.Publish(subject, strconv.AppendUint(nil, rev, 10)); err != nil {
		return fmt.Errorf("announce %s: %w", subject, err)
	}
	return nil
}

// maxFollowWait is the longest a follower waits between reads that failed or came back behind.
const maxFollowWait = 30 * time.Second
