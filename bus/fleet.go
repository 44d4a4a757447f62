package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

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

// PublishFirst stores msg in its stream only if its subject holds no message yet (the server checks it:
// Nats-Expected-Last-Subject-Sequence 0). It returns true when msg was stored, or when a retry of the same
// msg (same MsgID, within the stream's duplicate window) finds it stored; false when another message holds
// the subject. Two writers racing for one subject: exactly one gets true.
func (b *Bus) PublishFirst(ctx context.Context, msg RawMsg) (bool, error) {
	m := msg.natsMsg()
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		if isWrongLastSeq(err) {
			return false, nil
		}
		return false, fmt.Errorf("publish first to %s: %w", msg.Subject, err)
	}
	return true, nil
}

// PublishStored stores msg in its stream and waits for the ack (one message; see PublishMsgs for many).
func (b *Bus) PublishStored(ctx context.Context, msg RawMsg) (uint64, error) {
	ack, err := b.js.PublishMsg(ctx, msg.natsMsg())
	if err != nil {
		return 0, fmt.Errorf("publish to %s: %w", msg.Subject, err)
	}
	return ack.Sequence, nil
}

// IsTransient reports whether err is a connection or JetStream availability problem that a retry after a
// moment can fix (a server of the cluster went away, a stream leader is being elected).
func IsTransient(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		unavailable(err)
}

// unavailable: the server answered "JetStream system temporarily unavailable" or "no suitable peers"
// (503, while a cluster elects its leaders or lacks the servers a replicated stream needs).
func unavailable(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.Code == 503
}

// retryTransient runs op until it succeeds, fails for good, or ctx ends: a transient failure (IsTransient,
// not a permissions violation) is retried with exponential backoff (cenkalti, 250 ms to 5 s) and logged, so
// a worker starting while a cluster elects its leaders waits for it instead of exiting.
func (b *Bus) retryTransient(ctx context.Context, what string, op func(attempt context.Context) error) error {
	return b.retryTransientFor(ctx, what, 0, op)
}

// AttemptTimeout bounds one attempt of a retried call (the JetStream API's own default): a caller's long
// deadline (a command's --timeout) leaves room for retries instead of one attempt waiting all of it.
const AttemptTimeout = 5 * time.Second

// kvRetryFor bounds the retries of one key-value operation: a cluster that lost a server elects new stream
// leaders within seconds; past this the caller hears of the failure.
const kvRetryFor = 20 * time.Second

// retryTransientFor is retryTransient giving up after maxElapsed (0: only when ctx ends).
// op gets a context for the attempt (ctx bounded by AttemptTimeout); what must outlive the attempt (a
// watcher, a consumer's iterator) is made with ctx instead.
func (b *Bus) retryTransientFor(ctx context.Context, what string, maxElapsed time.Duration, op func(attempt context.Context) error) error {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 250 * time.Millisecond
	bo.MaxInterval = 5 * time.Second
	bo.MaxElapsedTime = maxElapsed
	attempt := 0
	return backoff.Retry(func() error {
		actx, cancel := context.WithTimeout(ctx, AttemptTimeout)
		err := op(actx)
		cancel()
		// A closed connection (Close was called) never comes back: not worth a retry.
		if err == nil || ctx.Err() != nil || errors.Is(err, ErrPermissionViolation) || !IsTransient(err) ||
			errors.Is(err, nats.ErrConnectionClosed) || b.nc.IsClosed() {
			if err != nil {
				return backoff.Permanent(err)
			}
			return nil
		}
		attempt++
		b.log.Warn("NATS not ready; retrying", "what", what, "attempt", attempt, "err", err)
		return err
	}, backoff.WithContext(bo, ctx))
}

// ServerName is the name of the server this connection is on now ("" when disconnected).
func (b *Bus) ServerName() string {
	if b.nc == nil || !b.nc.IsConnected() {
		return ""
	}
	return b.nc.ConnectedServerName()
}

// Stats are the messages and bytes this connection sent and received.
type Stats struct {
	InMsgs, OutMsgs, InBytes, OutBytes uint64
}

// Stats returns the connection's traffic counters.
func (b *Bus) Stats() Stats {
	s := b.nc.Stats()
	return Stats{InMsgs: s.InMsgs, OutMsgs: s.OutMsgs, InBytes: s.InBytes, OutBytes: s.OutBytes}
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

// ErrNoMessage is returned by LastMsg when no message of the stream has the subject.
var ErrNoMessage = errors.New("no message")

// LastMsg returns the last message of stream stored on subject (a direct lookup, no consumer), or an error
// wrapping ErrNoMessage.
func (b *Bus) LastMsg(ctx context.Context, stream, subject string) (StreamMsg, error) {
	s, err := b.js.Stream(ctx, stream)
	if err != nil {
		return StreamMsg{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, subject)
	if err != nil {
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return StreamMsg{}, fmt.Errorf("last message on %s: %w", subject, ErrNoMessage)
		}
		return StreamMsg{}, fmt.Errorf("last message on %s: %w", subject, err)
	}
	return StreamMsg{Subject: m.Subject, Seq: m.Sequence, Time: m.Time, Header: m.Header, Data: m.Data}, nil
}

// StreamNames lists every stream of the account (KV buckets are streams named KV_<bucket>).
func (b *Bus) StreamNames(ctx context.Context) ([]string, error) {
	var out []string
	l := b.js.StreamNames(ctx)
	for n := range l.Name() {
		out = append(out, n)
	}
	if err := l.Err(); err != nil {
		return out, fmt.Errorf("list streams: %w", err)
	}
	return out, nil
}

// SetStreamReplicas changes only the replica count of a stream (or of a bucket's KV_<bucket> stream),
// keeping the rest of its configuration: how an operator moves workers' R1 state onto every server of a
// cluster. It returns the replica count the stream had.
func (b *Bus) SetStreamReplicas(ctx context.Context, stream string, replicas int) (int, error) {
	s, err := b.js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s info: %w", stream, err)
	}
	cfg := info.Config
	old := cfg.Replicas
	if old == replicas {
		return old, nil
	}
	cfg.Replicas = replicas
	if _, err := b.js.UpdateStream(ctx, cfg); err != nil {
		return old, fmt.Errorf("set replicas of %s to %d: %w", stream, replicas, err)
	}
	return old, nil
}
