package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// permanentError marks an error that redelivery cannot fix.
type permanentError struct{ err error }

func (p permanentError) Error() string { return p.err.Error() }
func (p permanentError) Unwrap() error { return p.err }

// Permanent marks err as terminal: the message is terminated (not redelivered) with err as the reason and
// kept as a dead letter.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// ConsumerConfig configures a durable consumer.
type ConsumerConfig struct {
	Stream string
	// Durable is the consumer's name. It is API: renaming it redelivers the whole stream.
	Durable        string
	FilterSubjects []string
	// MaxAckPending bounds the messages in flight across every replica consuming this durable
	// (the server enforces it). Default 1000.
	MaxAckPending int
	// Concurrency is the number of handlers this process runs at once (default MaxAckPending, at most 256).
	Concurrency int
	// AckWait is how long the server waits for an ack before redelivering (default 30s). Long handlers call
	// Msg.InProgress.
	AckWait time.Duration
	// MaxDeliver bounds deliveries before the message becomes a dead letter (default 5).
	MaxDeliver int
	// Backoff is the redelivery delay after the n-th failure (the last value repeats); default 1s, 5s, 30s.
	Backoff []time.Duration
	// DeliverNew starts a new consumer at the end of the stream instead of the beginning.
	DeliverNew bool
	// Bind: use the consumer if it exists, never create or change it; Consume returns an error for which
	// IsConsumerNotFound holds when it does not (or no longer) exist.
	Bind bool
	// StallAfter is when the stall watchdog first looks at the consumer's info after its last delivery
	// (default 15s), then at periods that double up to 5 minutes (stallWatch); it makes the consumer anew
	// when the server holds no pull request of ours with a handler free, when messages wait and none is
	// delivered, or when the consumer does not answer twice. A lost pull request is not waited for: its
	// heartbeats stop, and it is sent again after two missed heartbeats (2 s by default, Options.PullHeartbeat), at no API cost.
	StallAfter time.Duration
	// MemoryStorage keeps the consumer's state (on a cluster, its Raft log too) in memory instead of files.
	// Used by the benchmarks that measure what it saves (docs/benchmarks.md).
	MemoryStorage bool
	// MemoryStorageWhenReplicated keeps the consumer's state in memory when its stream has more than one
	// replica, and in files on an R1 stream; the stream's replicas are read when the Bus first makes the
	// consumer, and a later make (the stall watchdog's) keeps the storage it had.
	// A replicated consumer's state then lives while a quorum of its servers runs (a server restarted
	// catches up from the others) and costs the servers no file write per delivery and ack; only a loss of
	// every server at once loses it, and the consumer then starts over from its deliver policy. For a work
	// queue stream, whose acked messages are gone, that delivers the unacked ones again; do not set it on a
	// limits stream, where it would deliver everything the stream holds. An existing consumer of the other
	// storage is kept as it is (compat_consumer_storage.go).
	MemoryStorageWhenReplicated bool
	// AsyncAck acks a handled message with a plain ack, not waiting for the server to confirm it, instead of
	// the default double ack (which on a replicated consumer waits for a Raft round of the consumer's group),
	// so the handler's slot takes the next message at once. Only for idempotent handlers: an ack the server
	// never got (a lost connection or server, a leader change) redelivers the message after AckWait, and its
	// second handling must change nothing (the fleet inventory: its sequence guard). Default
	// false: the puller's work queue and every other consumer confirm each ack before taking more.
	AsyncAck bool
	// Replicas of the consumer (0: the stream's). A work queue or interest stream refuses any other count
	// (err_code 10134), so the pull queues' consumers always have their stream's; the benchmarks use it on
	// limits streams (docs/benchmarks.md).
	Replicas int
	// Started, when set, is called once, when the consumer exists (made, or with Bind found) and the server
	// has its first pull request (sent and flushed): a message stored after Started returns is delivered to
	// the handlers. A worker closes its Ready with it. It runs on the consumer's pull goroutine and must not
	// block; it is never called when Consume fails first (a bound consumer that does not exist).
	Started func()
}

// Msg is one delivered message.
type Msg struct {
	Subject      string
	Data         []byte
	Header       nats.Header
	NumDelivered uint64
	StreamSeq    uint64
	d            *delivery
}

// InProgress tells the server the handler is still working, resetting the ack timer.
func (m *Msg) InProgress() error { return m.d.inProgress() }

// MsgHandler handles one message: nil acks it; a Permanent error terminates it (dead letter); any other error
// redelivers it after a backoff until MaxDeliver, then it becomes a dead letter.
type MsgHandler func(ctx context.Context, m *Msg) error

// Consume runs handlers on the durable consumer until ctx ends. It creates or updates the consumer (with
// Bind, only finds it).
func (b *Bus) Consume(ctx context.Context, cfg ConsumerConfig, h MsgHandler) error {
	cfg, cc := consumerSettings(cfg)
	initConsumerMetrics(cfg.Durable)
	return b.consume(ctx, cfg, cc, h)
}

// consumerSettings fills cfg's defaults and makes the server's consumer configuration of it.
func consumerSettings(cfg ConsumerConfig) (ConsumerConfig, jetstream.ConsumerConfig) {
	if cfg.MaxAckPending == 0 {
		cfg.MaxAckPending = 1000
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = min(cfg.MaxAckPending, 256)
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = 30 * time.Second
	}
	if cfg.MaxDeliver == 0 {
		cfg.MaxDeliver = 5
	}
	if len(cfg.Backoff) == 0 {
		cfg.Backoff = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second}
	}
	if cfg.StallAfter == 0 {
		cfg.StallAfter = 15 * time.Second
	}
	cc := jetstream.ConsumerConfig{
		Durable:        cfg.Durable,
		FilterSubjects: cfg.FilterSubjects,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        cfg.AckWait,
		MaxDeliver:     cfg.MaxDeliver,
		MaxAckPending:  cfg.MaxAckPending,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		MemoryStorage:  cfg.MemoryStorage,
		Replicas:       cfg.Replicas,
	}
	if cfg.DeliverNew {
		cc.DeliverPolicy = jetstream.DeliverNewPolicy
	}
	if len(cc.FilterSubjects) == 1 {
		// One filter goes in the create request's subject, so a server config can allow a user to create
		// this consumer with this filter only (deploy/natsconf). The server stores both forms alike.
		cc.FilterSubject, cc.FilterSubjects = cc.FilterSubjects[0], nil
	}
	return cfg, cc
}

func (b *Bus) consume(ctx context.Context, cfg ConsumerConfig, cc jetstream.ConsumerConfig, h MsgHandler) error {
	l := b.newPullLoop(fmt.Sprintf("consume %s on %s", cfg.Durable, cfg.Stream), cfg.Durable, cfg.Stream,
		cfg.Concurrency, cfg.Concurrency)
	l.onlyWhenFree = cfg.Concurrency == 1
	l.stallAfter = cfg.StallAfter
	l.started = cfg.Started
	l.open = func(ctx context.Context, _ uint64) (jetstream.Consumer, error) {
		var cons jetstream.Consumer
		err := b.retryTransient(ctx, "consumer "+cfg.Durable, func(actx context.Context) (err error) {
			if cons, err = b.openConsumer(actx, cfg, cc); err != nil {
				return fmt.Errorf("consumer %s on %s: %w", cfg.Durable, cfg.Stream, err)
			}
			return nil
		})
		return cons, err
	}
	l.handle = func(ctx context.Context, d *delivery) error {
		b.handle(ctx, cfg, d, h, l.pullsClosed)
		return nil
	}
	return l.start(ctx)
}

// handle runs h on d and acks (a double ack, or with AsyncAck a plain one), naks or terminates it by what h
// returned. A message handed back because the consumer stops is naked once pullsClosed is closed.
func (b *Bus) handle(ctx context.Context, cfg ConsumerConfig, d *delivery, h MsgHandler, pullsClosed <-chan struct{}) {
	m := &Msg{Subject: d.m.Subject, Data: d.m.Data, Header: d.m.Header, NumDelivered: d.numDelivered,
		StreamSeq: d.streamSeq, d: d}
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = Permanent(fmt.Errorf("handler panic: %v", r))
			}
		}()
		return h(ctx, m)
	}()
	log := b.log.With("subject", m.Subject, "stream_seq", m.StreamSeq)
	switch {
	case err == nil:
		countHandled(cfg.Durable, "ack", nil)
		if aErr := d.ack(context.WithoutCancel(ctx), !cfg.AsyncAck); aErr != nil {
			log.Warn("ack failed", "err", aErr)
		}
	case ctx.Err() != nil:
		// Shutting down: let another replica (or our restart) take it at once.
		countHandled(cfg.Durable, "nak", err)
		<-pullsClosed
		_ = d.nak(0)
	case IsPermanent(err) || int(m.NumDelivered) >= cfg.MaxDeliver:
		countHandled(cfg.Durable, "term", err)
		b.deadLetter(ctx, cfg, m, err)
		_ = d.term(truncate(err.Error(), 256))
	default:
		countHandled(cfg.Durable, "nak", err)
		delay := cfg.Backoff[min(int(m.NumDelivered)-1, len(cfg.Backoff)-1)]
		log.Warn("handler failed; redelivering", "attempt", m.NumDelivered, "max_deliver", cfg.MaxDeliver,
			"delay", delay, "err", err)
		_ = d.nak(delay)
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// Dead-letter headers.
const (
	HeaderDLQSubject    = "Imagefleet-Original-Subject"
	HeaderDLQReason     = "Imagefleet-Reason"
	HeaderDLQDeliveries = "Imagefleet-Deliveries"
	HeaderDLQStreamSeq  = "Imagefleet-Stream-Seq"
	HeaderDLQStream     = "Imagefleet-Stream"
)

func (b *Bus) deadLetter(ctx context.Context, cfg ConsumerConfig, m *Msg, reason error) {
	dm := deadLetterMsg(cfg.Stream, cfg.Durable, m.Subject, m.Header, m.Data, m.NumDelivered, m.StreamSeq, reason)
	if _, err := b.js.PublishMsg(context.WithoutCancel(ctx), dm); err != nil {
		b.log.Error("dead letter publish failed", "subject", m.Subject, "err", err)
		return
	}
	deadLetters.WithLabelValues(cfg.Durable).Inc()
}

// ConsumerState is what tests and operators want to see of a durable consumer.
type ConsumerState struct {
	// NumPending: stored, not yet delivered. NumAckPending: delivered, not yet acked (in flight).
	NumPending, NumAckPending, NumRedelivered int
	MaxAckPending                             int
	// NumWaiting is how many pull requests of its subscribers the server holds (0 while nobody pulls).
	NumWaiting int
	// Leader is the server leading the consumer in a cluster ("" on a single server).
	Leader string
	// MemoryStorage: the consumer's state is kept in memory (ConsumerConfig.MemoryStorageWhenReplicated).
	MemoryStorage bool
}

// Consumer reports the state of a durable consumer.
func (b *Bus) Consumer(ctx context.Context, stream, durable string) (ConsumerState, error) {
	c, err := b.js.Consumer(ctx, stream, durable)
	if err != nil {
		return ConsumerState{}, fmt.Errorf("consumer %s on %s: %w", durable, stream, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return ConsumerState{}, fmt.Errorf("consumer %s on %s info: %w", durable, stream, err)
	}
	return ConsumerState{NumPending: int(info.NumPending), NumAckPending: info.NumAckPending,
		NumRedelivered: info.NumRedelivered, MaxAckPending: info.Config.MaxAckPending, NumWaiting: info.NumWaiting,
		Leader: leader(info.Cluster), MemoryStorage: info.Config.MemoryStorage}, nil
}

// IsConsumerNotFound reports whether err says the consumer does not exist.
func IsConsumerNotFound(err error) bool { return errors.Is(err, jetstream.ErrConsumerNotFound) }
