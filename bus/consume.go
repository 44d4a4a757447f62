package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
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
	// StallAfter is when the stall watchdog first looks at the consumer's info after its last delivery
	// (default 15s), then at periods that double up to 5 minutes (stallWatch); it makes the consumer anew
	// when the server holds no pull request of ours with a handler free, when messages wait and none is
	// delivered, or when the consumer does not answer twice. A lost pull request is not waited for: its
	// heartbeats stop, and it is sent again within 2 s (pullHeartbeat), at no API cost.
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

// pullHeartbeat is the idle heartbeat every pull request asks for: the server holding a request of ours sends
// one each pullHeartbeat while it has nothing to deliver, so a request silent for 2*pullHeartbeat is gone and
// is sent again. A pull request can be lost without a word: one sent while no server takes the consumer's
// requests (the consumer being made anew, or electing a leader), one a server drops (a leader change; a full
// waiting queue, which nats-server answers with nothing when the request asks for heartbeats), one left on a
// server that went away. With nats.go's heartbeat (15 s, two missed) and the stall watchdog's first look
// (StallAfter) such a request was noticed after 25-30 s (TestConsumeNoticesALostPull). The heartbeats are
// pushed by the server that holds the request and take no JetStream API request: one a second per idle
// consumer, where a consumer info request (the watchdog's look) goes through the stream leader's API queue,
// which 10,000 agents saturated (stallWatch).
const pullHeartbeat = time.Second

// pullExpiry is how long a pull request waits at the server (nats.go's default): an idle consumer sends one
// every pullExpiry.
const pullExpiry = 30 * time.Second

// repullDelay is how long after the n-th pull request lost in a row (no delivery between) the next is sent: at
// once after the first, then after 1 s doubling up to pullExpiry, so a consumer whose requests keep being lost
// (it is gone, its Raft group has no leader, its server is too busy to send the heartbeats in time) asks no
// more often than an idle one does, instead of every 2 s.
func repullDelay(n int) time.Duration {
	if n <= 1 {
		return 0
	}
	return min(time.Second<<min(n-2, 5), pullExpiry)
}

// Why a pull request was found lost: the reason label of imagefleet_bus_pulls_lost_total.
const (
	lostNoHeartbeat     = "no_heartbeat"     // silent for 2*pullHeartbeat: the server holds it no more
	lostNoResponders    = "no_responders"    // no server took it (503): the consumer is gone or has no leader
	lostLeaderChanged   = "leader_changed"   // the consumer's new leader dropped it (409 Leadership Change)
	lostConsumerDeleted = "consumer_deleted" // the consumer was deleted (409 Consumer Deleted): made anew
	lostRefused         = "refused"          // another status ended it (409 Exceeded MaxWaiting, ...)
	lostWatchdog        = "watchdog"         // the stall watchdog's look at the consumer's info: made anew
)

var lostReasons = []string{lostNoHeartbeat, lostNoResponders, lostLeaderChanged, lostConsumerDeleted,
	lostRefused, lostWatchdog}

// pullLoop pulls one durable consumer's messages for at most Concurrency handlers. It speaks the pull protocol
// itself (pull requests to $JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>, answered on an inbox of ours) rather
// than through nats.go's iterators, whose bookkeeping (nats.go v1.55.0) lost pull requests:
//   - Messages and Consume skip the next pull request while their pull goroutine has not yet marked the
//     previous one sent (pullSubscription.checkPending, fetchInProgress). When that one was already answered in
//     full (one message, for a consumer with one handler), nothing is left to wake them and the consumer sits
//     idle until two heartbeats are missed: TestForeignRemovals's stall in CI; under -race, with 1 s heartbeats,
//     Consume waited 2 s every fifty messages or so of TestConsumeOneAtATimeNeverStalls;
//   - they take a pull request answered 503 (it reached no consumer) for a notice, and go on waiting for it;
//   - Messages keeps what arrives in a channel of Concurrency places and drops what does not fit: with
//     heartbeats short enough to notice a lost request in seconds, those of a request waiting while every
//     handler is busy take the places of the messages that follow, which come back only after AckWait.
//
// Here one goroutine (run) keeps the account (pull), reads whatever comes at once (heartbeats included, so
// none takes a message's place), reads every status the server answers with, and sends a request again as
// soon as the one it has is known gone.
type pullLoop struct {
	b   *Bus
	cfg ConsumerConfig
	cc  jetstream.ConsumerConfig
	h   MsgHandler
	log *slog.Logger
	// next is the consumer's pull request subject; inbox, where its messages and statuses come.
	next, inbox string

	cons       atomic.Pointer[jetstream.Consumer]
	busy       atomic.Int32  // handlers running
	lastActive atomic.Int64  // unix nanoseconds of the last delivery or (re)opening of the consumer
	lastDeliv  atomic.Int64  // unix nanoseconds of the last delivery (or the start)
	hint       chan struct{} // to the watchdog: look soon
	reopen     chan struct{} // from the watchdog: make the consumer anew
	freed      chan struct{} // a handler finished
	opened     chan error    // the result of open in the background (reopening)
	wg         sync.WaitGroup
	// pullsClosed is closed at shutdown once the pull subscription is gone at the server (shutdown).
	pullsClosed chan struct{}

	// Kept by run's goroutine alone.
	free        int         // handlers not running
	outstanding int         // messages asked for that the server has neither delivered nor released
	queue       []*delivery // delivered, waiting for a free handler
	heard       time.Time   // the last message or heartbeat on the inbox, or the first request sent since
	lostInRow   int         // pull requests found lost since the last delivery
	holdUntil   time.Time   // no request before this (repullDelay)
	opening     bool        // the consumer is being made anew: no request meanwhile
}

// pullRequest is the body of a pull request (nats-server's JSApiConsumerGetNextRequest).
type pullRequest struct {
	Batch     int           `json:"batch"`
	Expires   time.Duration `json:"expires"`
	Heartbeat time.Duration `json:"idle_heartbeat"`
}

func (b *Bus) consume(ctx context.Context, cfg ConsumerConfig, cc jetstream.ConsumerConfig, h MsgHandler) error {
	l := &pullLoop{b: b, cfg: cfg, cc: cc, h: h, log: b.log.With("stream", cfg.Stream, "consumer", cfg.Durable),
		next:  b.apiPrefix(cfg.Stream) + "CONSUMER.MSG.NEXT." + cfg.Stream + "." + cfg.Durable,
		inbox: b.nc.NewInbox(), hint: make(chan struct{}, 1), reopen: make(chan struct{}, 1),
		freed: make(chan struct{}, cfg.Concurrency), opened: make(chan error, 1), pullsClosed: make(chan struct{}),
		free: cfg.Concurrency}
	l.lastDeliv.Store(time.Now().UnixNano())
	if err := l.open(ctx); err != nil {
		return err
	}
	return l.run(ctx)
}

// open creates (or finds) the consumer, retrying while the server is not ready: at the start, and to make it
// anew (it was deleted, its server or leader is gone).
func (l *pullLoop) open(ctx context.Context) error {
	return l.b.retryTransient(ctx, "consumer "+l.cfg.Durable, func(actx context.Context) error {
		cons, err := l.b.openConsumer(actx, l.cfg, l.cc)
		if err != nil {
			return fmt.Errorf("consumer %s on %s: %w", l.cfg.Durable, l.cfg.Stream, err)
		}
		l.cons.Store(&cons)
		l.lastActive.Store(time.Now().UnixNano())
		return nil
	})
}

func (l *pullLoop) run(ctx context.Context) error {
	// run reads it at once, whatever the handlers do; a full channel would drop what comes (nats.go's slow
	// consumer), and no more than Concurrency messages are asked for at a time.
	in := make(chan *nats.Msg, 2*l.cfg.Concurrency+64)
	sub, err := l.b.nc.ChanSubscribe(l.inbox, in)
	if err != nil {
		return fmt.Errorf("consume %s on %s: %w", l.cfg.Durable, l.cfg.Stream, err)
	}
	closed := make(chan struct{})
	var closeOnce sync.Once
	sub.SetClosedHandler(func(string) { closeOnce.Do(func() { close(closed) }) })
	// A reconnection loses the requests the server held for the connection; a closed connection ends the loop.
	status := l.b.nc.StatusChanged(nats.CONNECTED, nats.CLOSED)
	defer l.b.nc.RemoveStatusListener(status)
	// stop ends the loop's context, so the shutdown below runs for an error return as for a shutdown.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		l.watch(ctx)
	}()
	var loopErr error
	wake := time.NewTimer(2 * pullHeartbeat) // for the heartbeats and repullDelay
	defer wake.Stop()
	l.pull()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			continue
		case m := <-in:
			if err := l.received(ctx, m); err != nil {
				loopErr = err
				stop()
				continue
			}
		case <-l.freed:
			l.free++
			l.dispatch(ctx)
		case <-wake.C:
		case s, ok := <-status:
			if !ok || s == nats.CLOSED {
				stop() // the connection's owner closed it: its shutdown, not the consumer's failure
				continue
			}
			l.outstanding = 0 // reconnected
		case <-l.reopen:
			l.makeAnew(ctx)
		case err := <-l.opened:
			l.opening = false
			// A closed connection is its owner's shutdown, not the consumer's failure.
			if err != nil && ctx.Err() == nil && !l.b.nc.IsClosed() {
				loopErr = err // not transient: the consumer cannot be had (permissions, a conflicting config)
				stop()
				continue
			}
			// Made anew: pull at once, whatever the losses before held back.
			l.outstanding, l.holdUntil = 0, time.Time{}
		}
		now := time.Now()
		if l.outstanding > 0 && now.Sub(l.heard) >= 2*pullHeartbeat {
			l.lost(lostNoHeartbeat, nil)
		}
		l.pull()
		next := 2 * pullHeartbeat
		if l.outstanding > 0 {
			next = l.heard.Add(2 * pullHeartbeat).Sub(now)
		}
		if now.Before(l.holdUntil) {
			next = min(next, l.holdUntil.Sub(now))
		}
		wake.Reset(max(next, time.Millisecond))
	}
	l.shutdown(sub, in, closed)
	<-watched
	return loopErr
}

// pull asks for messages unless requests are held back: up to Concurrency not yet started (asked for, or
// delivered and queued), as nats.go's iterators did, so a handler that finishes takes the next message at
// once (asking only for free handlers cost 30-40% of the throughput of 16 handlers with double acks); it asks
// again once fewer than half are left, so a busy consumer sends one request per several messages. A consumer
// with one handler asks only while it is free: no message waits unstarted behind a running handler, so a
// stopping consumer holds none it must hand back, and the server holds no pull request of ours that a
// message naked by a stopping handler would be redelivered into (TestPullSurvivesRestart saw that third
// delivery).
func (l *pullLoop) pull() {
	limit := l.cfg.Concurrency
	if limit == 1 {
		limit = l.free
	}
	pending := l.outstanding + len(l.queue)
	want := limit - pending
	if want < 1 || pending >= (limit+1)/2 || l.opening || time.Now().Before(l.holdUntil) {
		return
	}
	body, _ := json.Marshal(pullRequest{Batch: want, Expires: pullExpiry, Heartbeat: pullHeartbeat})
	if err := l.b.nc.PublishRequest(l.next, l.inbox, body); err != nil {
		if !l.b.nc.IsClosed() {
			l.lost(lostRefused, err)
		}
		return
	}
	if l.outstanding == 0 {
		l.heard = time.Now() // the heartbeats' clock starts with the request
	}
	l.outstanding += want
}

// lost records a pull request found lost: what it asked for is asked again, at once or after repullDelay.
func (l *pullLoop) lost(reason string, err error) {
	l.outstanding = 0
	l.lostInRow++
	delay := repullDelay(l.lostInRow)
	l.holdUntil = time.Now().Add(delay)
	countLostPull(l.cfg.Durable, reason)
	l.log.Warn("pull request lost; pulling anew", "reason", reason, "in", delay, "lost_in_row", l.lostInRow,
		"idle", time.Since(time.Unix(0, l.lastDeliv.Load())).Round(time.Millisecond), "err", err)
	if l.lostInRow >= 2 {
		// The request sent again was lost too: the consumer may be gone or without a leader, which only its
		// info tells, and only making it anew mends.
		select {
		case l.hint <- struct{}{}:
		default:
		}
	}
}

// makeAnew makes (or finds) the consumer anew in the background, unless that is under way; run hears of it
// on opened, and pulls again.
func (l *pullLoop) makeAnew(ctx context.Context) {
	if l.opening {
		return
	}
	l.opening, l.outstanding = true, 0
	go func() { l.opened <- l.open(ctx) }()
}

// received takes a message of the inbox: a message for a handler, or a status of a pull request. An error
// ends the loop.
func (l *pullLoop) received(ctx context.Context, m *nats.Msg) error {
	l.heard = time.Now()
	status := ""
	if len(m.Data) == 0 && len(m.Header) > 0 {
		status = m.Header.Get("Status")
	}
	if status == "" {
		l.outstanding = max(l.outstanding-1, 0)
		d, err := newDelivery(l.b.nc, m)
		if err != nil {
			l.log.Warn("delivery without its metadata; left to be redelivered", "subject", m.Subject, "err", err)
			return nil
		}
		now := time.Now().UnixNano()
		l.lastActive.Store(now)
		l.lastDeliv.Store(now)
		l.lostInRow, l.holdUntil = 0, time.Time{}
		l.queue = append(l.queue, d)
		l.dispatch(ctx)
		return nil
	}
	descr := m.Header.Get("Description")
	if status == "100" { // an idle heartbeat
		return nil
	}
	// A request that ended as requests do (expired, its reply subject gone, a message over its byte limit)
	// says how much of it was not delivered.
	if left, err := strconv.Atoi(m.Header.Get("Nats-Pending-Messages")); err == nil && (status == "408" || status == "409") {
		l.outstanding = max(l.outstanding-left, 0)
		return nil
	}
	switch d := strings.ToLower(descr); {
	case status == "400":
		return fmt.Errorf("consume %s on %s: pull request refused: %s %s", l.cfg.Durable, l.cfg.Stream, status, descr)
	case status == "503":
		l.lost(lostNoResponders, nats.ErrNoResponders)
	case status == "409" && strings.Contains(d, "leadership change"):
		l.lost(lostLeaderChanged, nil)
	case status == "409" && strings.Contains(d, "consumer deleted"):
		countLostPull(l.cfg.Durable, lostConsumerDeleted)
		l.log.Warn("consumer deleted; making it anew")
		l.makeAnew(ctx)
	default:
		l.lost(lostRefused, fmt.Errorf("%s %s", status, descr))
	}
	return nil
}

// dispatch starts queued messages on free handlers.
func (l *pullLoop) dispatch(ctx context.Context) {
	for l.free > 0 && len(l.queue) > 0 && ctx.Err() == nil {
		d := l.queue[0]
		l.queue = l.queue[1:]
		l.free--
		l.busy.Add(1)
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			defer func() { l.busy.Add(-1); l.freed <- struct{}{} }()
			l.b.handle(ctx, l.cfg, d, l.h, l.pullsClosed)
		}()
	}
}

// shutdown hands back what was delivered but not started once the pull subscription is gone at the server
// (drained: its unsubscribe went out before the naks, on the same connection), so the server cannot
// redeliver a message into a pull request of this stopping consumer, which would hand it back again and spend
// one more of its MaxDeliver deliveries; then it waits for the handlers and a making anew under way.
func (l *pullLoop) shutdown(sub *nats.Subscription, in <-chan *nats.Msg, closed <-chan struct{}) {
	handBack := l.queue
	l.queue = nil
	take := func(m *nats.Msg) {
		if len(m.Data) > 0 || m.Header.Get("Status") == "" {
			if d, err := newDelivery(l.b.nc, m); err == nil {
				handBack = append(handBack, d)
			}
		}
	}
	if err := sub.Drain(); err == nil {
		// Bounded: a connection that is down does not complete the drain.
		timeout := time.NewTimer(2 * time.Second)
		defer timeout.Stop()
	drain:
		for {
			select {
			case m := <-in:
				take(m)
			case <-closed:
				break drain
			case <-timeout.C:
				break drain
			}
		}
	}
	// What the server sent before the unsubscribe is in the channel by now (the drain flushed).
	for len(in) > 0 {
		take(<-in)
	}
	close(l.pullsClosed)
	for _, d := range handBack {
		_ = d.nak(0)
	}
	l.wg.Wait()
	if l.opening {
		<-l.opened
	}
}

// watch is the stall watchdog: on stallWatch's schedule it looks at the consumer's info and has run make the
// consumer anew when the server holds no pull request of ours while a handler is free, when messages wait
// and none is delivered, or when the consumer does not answer.
func (l *pullLoop) watch(ctx context.Context) {
	t := time.NewTicker(max(l.cfg.StallAfter/3, 10*time.Millisecond))
	defer t.Stop()
	w := newStallWatch(l.cfg.StallAfter, time.Now())
	for {
		hinted := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-l.hint:
			hinted = true
		}
		now := time.Now()
		last := time.Unix(0, l.lastActive.Load())
		if !w.due(now, time.Unix(0, l.lastDeliv.Load()), last, hinted) {
			continue
		}
		idle := now.Sub(last)
		ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
		info, err := (*l.cons.Load()).Info(ictx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		room := int(l.busy.Load()) < l.cfg.Concurrency
		var verdict stallVerdict
		if err == nil {
			verdict = judgeStall(info.NumPending, info.NumAckPending, info.Config.MaxAckPending, info.NumWaiting, room)
		}
		switch w.checked(now, err, verdict) {
		case stallOK, stallSuspect:
			continue
		case stallNoAnswer:
			// The consumer did not answer twice in a row (deleted, no leader yet, or its server is gone): make
			// it anew, which waits for the cluster.
			l.log.Warn("consumer does not answer; making it anew", "idle", idle.Round(time.Second), "err", err)
		case stallNoWaiting:
			// Room for messages here, but the server holds no pull request of this consumer, and no
			// heartbeat went missing.
			l.log.Warn("consumer has no pull request waiting; making it anew",
				"pending", info.NumPending, "ack_pending", info.NumAckPending, "idle", idle.Round(time.Second))
		case stallStuck:
			l.log.Warn("consumer stalled: messages wait but none was delivered; making it anew",
				"pending", info.NumPending, "idle", idle.Round(time.Second))
		}
		countLostPull(l.cfg.Durable, lostWatchdog)
		l.lastActive.Store(time.Now().UnixNano())
		select {
		case l.reopen <- struct{}{}:
		default: // one is already asked for
		}
	}
}

// delivery is a message the consumer delivered, acked on its reply subject:
// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>, or with the domain and
// the account hash after ACK and a token more at the end.
type delivery struct {
	nc                      *nats.Conn
	m                       *nats.Msg
	numDelivered, streamSeq uint64
}

func newDelivery(nc *nats.Conn, m *nats.Msg) (*delivery, error) {
	tokens := strings.Split(m.Reply, ".")
	if len(tokens) < 9 || tokens[0] != "$JS" || tokens[1] != "ACK" || len(tokens) == 10 {
		return nil, fmt.Errorf("ack subject %q", m.Reply)
	}
	if len(tokens) > 9 {
		tokens = append(tokens[:2:2], tokens[4:]...) // the domain and the account hash out
	}
	delivered, err1 := strconv.ParseUint(tokens[4], 10, 64)
	seq, err2 := strconv.ParseUint(tokens[5], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("ack subject %q: %w", m.Reply, err)
	}
	return &delivery{nc: nc, m: m, numDelivered: delivered, streamSeq: seq}, nil
}

// ack acks the message; a double ack waits for the server to confirm it, for AttemptTimeout at most (as
// nats.go's does without a deadline).
func (d *delivery) ack(ctx context.Context, double bool) error {
	if !double {
		return d.nc.Publish(d.m.Reply, []byte("+ACK"))
	}
	ctx, cancel := context.WithTimeout(ctx, AttemptTimeout)
	defer cancel()
	_, err := d.nc.RequestWithContext(ctx, d.m.Reply, []byte("+ACK"))
	return err
}

// nak hands the message back, redelivered after delay (0: at once).
func (d *delivery) nak(delay time.Duration) error {
	if delay > 0 {
		return d.nc.Publish(d.m.Reply, fmt.Appendf(nil, `-NAK {"delay": %d}`, delay.Nanoseconds()))
	}
	return d.nc.Publish(d.m.Reply, []byte("-NAK"))
}

// term terminates the message with reason: it is not redelivered.
func (d *delivery) term(reason string) error { return d.nc.Publish(d.m.Reply, []byte("+TERM "+reason)) }

// inProgress resets the message's ack timer.
func (d *delivery) inProgress() error { return d.nc.Publish(d.m.Reply, []byte("+WPI")) }

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
