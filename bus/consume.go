package bus

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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
	// StallAfter: when messages wait (the consumer's NumPending > 0, a free ack slot) and none has been
	// delivered for this long, the pull is started anew (default 15s). A pull request left on a server that
	// was lost or lost its leadership is not always reported by a missed heartbeat. An idle consumer's info
	// is asked StallAfter after its last delivery, then at periods that double up to 5 minutes (stallWatch);
	// a replicated consumer's also once about 2 s after its pull (re)starts (stallWatch.started).
	StallAfter time.Duration
	// MemoryStorage keeps the consumer's state (on a cluster, its Raft log too) in memory instead of files.
	// Used by the benchmarks that measure what it saves (docs/benchmarks.md); no worker sets it.
	MemoryStorage bool
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
}

// Msg is one delivered message.
type Msg struct {
	Subject      string
	Data         []byte
	Header       nats.Header
	NumDelivered uint64
	StreamSeq    uint64
	m            jetstream.Msg
}

// InProgress tells the server the handler is still working, resetting the ack timer.
func (m *Msg) InProgress() error { return m.m.InProgress() }

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
	log := b.log.With("stream", cfg.Stream, "consumer", cfg.Durable)
	// open creates (or finds) the consumer and starts pulling from it. It is also how the loop recovers
	// when pulling fails (a server of the cluster lost, the consumer's leader moved): the pull requests
	// went to a server that is gone, so new ones are made, once the consumer answers again.
	var (
		mu         sync.Mutex
		current    jetstream.MessagesContext
		currentCon jetstream.Consumer
		lastActive atomic.Int64 // unix nanoseconds of the last delivery or (re)start of the pull
		lastDeliv  atomic.Int64 // unix nanoseconds of the last delivery (or the start)
		// replStart: unix nanoseconds of the last (re)start of a replicated consumer's pull, until the
		// watchdog took it for an early look (stallWatch.started); 0 otherwise.
		replStart atomic.Int64
	)
	lastDeliv.Store(time.Now().UnixNano())
	open := func() (jetstream.MessagesContext, error) {
		var msgs jetstream.MessagesContext
		err := b.retryTransient(ctx, "consumer "+cfg.Durable, func(actx context.Context) error {
			cons, err := b.openConsumer(actx, cfg, cc)
			if err != nil {
				return fmt.Errorf("consumer %s on %s: %w", cfg.Durable, cfg.Stream, err)
			}
			msgs, err = cons.Messages(jetstream.PullMaxMessages(cfg.Concurrency), jetstream.WithMessagesErrOnMissingHeartbeat(true))
			if err != nil {
				return fmt.Errorf("consume %s on %s: %w", cfg.Durable, cfg.Stream, err)
			}
			mu.Lock()
			currentCon = cons
			mu.Unlock()
			lastActive.Store(time.Now().UnixNano())
			if replicated(cons) {
				replStart.Store(time.Now().UnixNano())
			}
			return nil
		})
		return msgs, err
	}
	first, err := open()
	if err != nil {
		return err
	}
	// stop ends the loop's context, so the stopper below runs for an error return as for a shutdown.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var loopErr error
	mu.Lock()
	current = first
	mu.Unlock()
	// A handler slot is taken before a message is pulled, never after: a message is fetched only when a
	// handler can start it at once. With Concurrency 1 no message waits here unstarted behind a running
	// handler, so a stopping consumer holds none it must hand back, and the server holds no pull request of
	// ours that a message naked by a stopping handler would be redelivered into (TestPullSurvivesRestart
	// saw that third delivery).
	sem := make(chan struct{}, cfg.Concurrency)
	var busy atomic.Int32 // handlers running
	// A missed heartbeat (nats.go got none of the server's heartbeats for a pull request of ours for two
	// periods: the request, or its server, is gone) is a reason for the watchdog to look at once.
	hint := make(chan struct{}, 1)
	// The stall watchdog: stopping the iterator makes the loop below pull anew.
	go func() {
		t := time.NewTicker(max(cfg.StallAfter/3, 10*time.Millisecond))
		defer t.Stop()
		w := newStallWatch(cfg.StallAfter, time.Now())
		for {
			hinted := false
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			case <-hint:
				hinted = true
			}
			now := time.Now()
			last := time.Unix(0, lastActive.Load())
			if at := replStart.Load(); at != 0 && now.Sub(time.Unix(0, at)) >= earlyLookAfter && replStart.CompareAndSwap(at, 0) {
				w.started()
			}
			if !w.due(now, time.Unix(0, lastDeliv.Load()), last, hinted) {
				continue
			}
			idle := now.Sub(last)
			mu.Lock()
			cons, msgs := currentCon, current
			mu.Unlock()
			ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
			info, err := cons.Info(ictx)
			cancel()
			if ctx.Err() != nil {
				return
			}
			room := int(busy.Load()) < cfg.Concurrency
			var verdict stallVerdict
			if err == nil {
				verdict = judgeStall(info.NumPending, info.NumAckPending, info.Config.MaxAckPending, info.NumWaiting, room)
			}
			switch w.checked(now, err, verdict) {
			case stallOK, stallSuspect:
				continue
			case stallNoAnswer:
				// The consumer did not answer twice in a row (no leader yet, or its server is gone): make
				// it anew, which waits for the cluster.
				log.Warn("consumer does not answer; pulling anew", "idle", idle.Round(time.Second), "err", err)
			case stallNoWaiting:
				// Room for messages here, but the server holds no pull request of this consumer: ours went
				// to a server that is gone and nats.go has not noticed (the fleet test's pullers missed a
				// pre-pull command for 90 s after a server was killed).
				log.Warn("consumer has no pull request waiting; pulling anew",
					"pending", info.NumPending, "ack_pending", info.NumAckPending, "idle", idle.Round(time.Second))
			case stallStuck:
				log.Warn("consumer stalled: messages wait but none was delivered; pulling anew",
					"pending", info.NumPending, "idle", idle.Round(time.Second))
			}
			lastActive.Store(time.Now().UnixNano())
			msgs.Stop()
		}
	}()
	// Shutting down, a message is handed back (naked) only once the pull subscription is gone at the
	// server (drained: its unsubscribe went out before the nak, on the same connection), so the server
	// cannot redeliver it into a pull request of this stopping consumer, which would hand it back again and
	// spend one more of its MaxDeliver deliveries.
	pullsClosed := make(chan struct{})
	var handBack []jetstream.Msg // delivered after the cancel, never started
	var wg sync.WaitGroup
	stopped := make(chan struct{})
	go func() {
		<-ctx.Done()
		mu.Lock()
		current.Drain()
		mu.Unlock()
		close(stopped)
	}()
	rechecks := len(recheckWaits)
	for ctx.Err() == nil {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			continue
		}
		mu.Lock()
		msgs := current
		mu.Unlock()
		jm, err := next(msgs, &rechecks)
		if errors.Is(err, jetstream.ErrNoHeartbeat) && ctx.Err() == nil {
			// nats.go has already asked anew (it forgets its pending requests); the watchdog checks that
			// the server holds one.
			<-sem
			select {
			case hint <- struct{}{}:
			default:
			}
			continue
		}
		if err != nil {
			<-sem
			if ctx.Err() != nil {
				break
			}
			log.Warn("consume next failed; pulling anew", "err", err)
			msgs.Stop()
			select {
			case <-stopped:
			case <-time.After(250 * time.Millisecond):
			}
			fresh, oErr := open()
			if oErr != nil {
				// A closed connection is its owner's shutdown, not the consumer's failure.
				if ctx.Err() == nil && !b.nc.IsClosed() {
					loopErr = oErr // not transient: the consumer cannot be had (permissions, a conflicting config)
					stop()
				}
				break
			}
			mu.Lock()
			if ctx.Err() != nil {
				fresh.Stop()
			}
			current = fresh
			mu.Unlock()
			rechecks = len(recheckWaits)
			continue
		}
		lastActive.Store(time.Now().UnixNano())
		lastDeliv.Store(time.Now().UnixNano())
		rechecks = 0
		if ctx.Err() != nil {
			<-sem
			handBack = append(handBack, jm)
			continue
		}
		busy.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { busy.Add(-1); <-sem }()
			b.handle(ctx, cfg, jm, h, pullsClosed)
		}()
	}
	<-stopped
	// Wait for the drain (bounded: a connection that is down does not complete it), taking what it still
	// delivers, then hand back.
	mu.Lock()
	last := current
	mu.Unlock()
	for deadline := time.Now().Add(2 * time.Second); ; {
		wait := time.Until(deadline)
		if wait <= 0 {
			break
		}
		jm, err := last.Next(jetstream.NextMaxWait(wait))
		if err != nil {
			break
		}
		handBack = append(handBack, jm)
	}
	close(pullsClosed)
	for _, jm := range handBack {
		_ = jm.Nak()
	}
	wg.Wait()
	return loopErr
}

// replicated reports whether cons has replicas besides its leader (its Raft group can be without a leader),
// as its create or lookup answer said.
func replicated(cons jetstream.Consumer) bool {
	info := cons.CachedInfo()
	return info != nil && info.Cluster != nil && len(info.Cluster.Replicas) > 0
}

// recheckWaits are the waits of the Next calls that follow a delivery, before one that waits without end.
// nats.go's iterator sends its next pull request from Next, but skips it while its own pull goroutine has
// not yet marked the previous request sent (pullSubscription.fetchInProgress, nats.go v1.55.0). When that
// request was already answered in full (with PullMaxMessages(1): by the one message just handed out), the
// server holds none of ours and nothing comes to wake Next to send it: the consumer stalls until nats.go
// misses two heartbeats (30 s) or the watchdog steps in (StallAfter), with messages waiting. Under -race
// TestConsumeOneAtATimeNeverStalls stalled so two runs in three. Each Next call starts with the request the
// previous one skipped, so a few short, growing waits after a delivery close that gap; an idle consumer
// then waits in one call again, at no cost.
var recheckWaits = []time.Duration{5 * time.Millisecond, 20 * time.Millisecond, 80 * time.Millisecond,
	320 * time.Millisecond, 1280 * time.Millisecond}

// next returns the iterator's next message; rechecks counts the short waits spent since the last delivery.
func next(msgs jetstream.MessagesContext, rechecks *int) (jetstream.Msg, error) {
	for *rechecks < len(recheckWaits) {
		jm, err := msgs.Next(jetstream.NextMaxWait(recheckWaits[*rechecks]))
		if !errors.Is(err, nats.ErrTimeout) {
			return jm, err
		}
		*rechecks++
	}
	return msgs.Next()
}

// handle runs h on jm and acks (a double ack, or with AsyncAck a plain one), naks or terminates it by what h
// returned. A message handed back because the consumer stops is naked once pullsClosed is closed.
func (b *Bus) handle(ctx context.Context, cfg ConsumerConfig, jm jetstream.Msg, h MsgHandler, pullsClosed <-chan struct{}) {
	meta, _ := jm.Metadata()
	m := &Msg{Subject: jm.Subject(), Data: jm.Data(), Header: jm.Headers(), m: jm}
	if meta != nil {
		m.NumDelivered, m.StreamSeq = meta.NumDelivered, meta.Sequence.Stream
	}
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
		var aErr error
		if cfg.AsyncAck {
			aErr = jm.Ack()
		} else {
			aErr = jm.DoubleAck(context.WithoutCancel(ctx))
		}
		if aErr != nil {
			log.Warn("ack failed", "err", aErr)
		}
	case ctx.Err() != nil:
		// Shutting down: let another replica (or our restart) take it at once.
		countHandled(cfg.Durable, "nak", err)
		<-pullsClosed
		_ = jm.Nak()
	case IsPermanent(err) || int(m.NumDelivered) >= cfg.MaxDeliver:
		countHandled(cfg.Durable, "term", err)
		b.deadLetter(ctx, cfg, m, err)
		_ = jm.TermWithReason(truncate(err.Error(), 256))
	default:
		countHandled(cfg.Durable, "nak", err)
		delay := cfg.Backoff[min(int(m.NumDelivered)-1, len(cfg.Backoff)-1)]
		log.Warn("handler failed; redelivering", "attempt", m.NumDelivered, "max_deliver", cfg.MaxDeliver,
			"delay", delay, "err", err)
		_ = jm.NakWithDelay(delay)
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
		Leader: leader(info.Cluster)}, nil
}

// IsConsumerNotFound reports whether err says the consumer does not exist.
func IsConsumerNotFound(err error) bool { return errors.Is(err, jetstream.ErrConsumerNotFound) }
