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

// DefaultPullHeartbeat is the idle heartbeat every pull request asks for unless Options.PullHeartbeat says
// otherwise: the server holding a request of ours sends one each heartbeat while it has nothing to deliver,
// so a request silent for two heartbeats is gone and
// is sent again. A pull request can be lost without a word: one sent while no server takes the consumer's
// requests (the consumer being made anew, or electing a leader), one a server drops (a leader change; a full
// waiting queue, which nats-server answers with nothing when the request asks for heartbeats), one left on a
// server that went away. With nats.go's heartbeat (15 s, two missed) and the stall watchdog's first look
// (StallAfter) such a request was noticed after 25-30 s (TestConsumeNoticesALostPull). The heartbeats are
// pushed by the server that holds the request and take no JetStream API request: one a second per idle
// consumer, where a consumer info request (the watchdog's look) goes through the stream leader's API queue,
// which 10,000 agents saturated (stallWatch).
//
// At rest each idle consumer costs one message a second (three per agent with the default workers). Of
// 2,000 hollow agents at rest on this project's 2-core machine, 5 s instead of 1 s took the three servers
// from 0.77-0.84 to 0.55-0.61 CPU-s/s and the agents' process from 0.49-0.56 to 0.37-0.41
// (docs/scale.md): Options.PullHeartbeat (`--pull-heartbeat`) is the trade for a large fleet.
const DefaultPullHeartbeat = time.Second

// MinPullHeartbeat and MaxPullHeartbeat bound Options.PullHeartbeat: the longest keeps two heartbeats inside a
// request's pullExpiry with room, so an idle request is still heard from before it expires.
const (
	MinPullHeartbeat = time.Second
	MaxPullHeartbeat = 10 * time.Second
)

// pullExpiry is how long a pull request waits at the server (nats.go's default): an idle consumer sends one
// every pullExpiry.
const pullExpiry = 30 * time.Second

// repullDelay is how long after the n-th pull request lost in a row (no delivery between) the next is sent: at
// once after the first, then after 1 s doubling up to pullExpiry, so a consumer whose requests keep being lost
// (it is gone, its Raft group has no leader, its server is too busy to send the heartbeats in time) asks no
// more often than an idle one does, instead of every 2 s. An ordered reader makes its consumer anew after as
// long, for the same reason.
func repullDelay(n int) time.Duration {
	if n <= 1 {
		return 0
	}
	return min(time.Second<<min(n-2, 5), pullExpiry)
}

// Why a pull request was found lost: the reason label of imagefleet_bus_pulls_lost_total.
const (
	lostNoHeartbeat     = "no_heartbeat"     // silent for two heartbeats: the server holds it no more
	lostNoResponders    = "no_responders"    // no server took it (503): the consumer is gone or has no leader
	lostLeaderChanged   = "leader_changed"   // the consumer's new leader dropped it (409 Leadership Change)
	lostConsumerDeleted = "consumer_deleted" // the consumer was deleted (409 Consumer Deleted): made anew
	lostRefused         = "refused"          // another status ended it (409 Exceeded MaxWaiting, ...)
	lostWatchdog        = "watchdog"         // the stall watchdog's look at the consumer's info: made anew
	lostSequenceGap     = "sequence_gap"     // an ordered reader's delivery skipped one: made anew after the last
)

var lostReasons = []string{lostNoHeartbeat, lostNoResponders, lostLeaderChanged, lostConsumerDeleted,
	lostRefused, lostWatchdog, lostSequenceGap}

// pullLoop pulls one consumer's messages for its handlers: a durable consumer's for Consume, an ordered
// reader's for Read. It speaks the pull protocol itself (pull requests to
// $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>, answered on an inbox of ours) rather than through nats.go's
// iterators, whose bookkeeping (nats.go v1.55.0) lost pull requests:
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
	log *slog.Logger
	// what names the loop in its errors ("consume <durable> on <stream>", "tail <stream>"); name labels its
	// metrics (the durable's name, or tail:<stream>).
	what, name, stream string
	// window is how many messages are asked for ahead of the handlers (asked for, or delivered and queued);
	// handlers is how many run at once. onlyWhenFree asks only while a handler is free (below, pull).
	window, handlers int
	onlyWhenFree     bool
	// ordered is a stream's ordered reader (Read): each open makes a consumer of its own (no acks, no state
	// at the server), starting after the last message taken. Its deliveries must follow each other: one that
	// skips makes the consumer anew after the last message taken (nats.go's ordered consumer did the same).
	// A request no consumer took (503), or the second lost in a row, makes it anew too: it holds no state
	// worth waiting for, so no stall watchdog looks at its info, at no API cost while it is idle. What the
	// handlers had not started when the loop stops is dropped, not handed back.
	ordered bool
	// endWhenIdle ends the loop (run returns errReadEnd) on an idle heartbeat while no message is queued or
	// handled: the consumer has nothing left to deliver (a reader to the end whose last messages went before
	// their delivery).
	endWhenIdle bool
	// open makes (or finds) the consumer, retrying while the server is not ready: at the start, and to make it
	// anew (it was deleted, its server or leader is gone; an ordered reader's skipped a message). from is the
	// stream sequence an ordered reader goes on from (0: where it started). It runs while run takes no message.
	open func(ctx context.Context, from uint64) (jetstream.Consumer, error)
	// handle runs one message on a handler's goroutine; an error ends the loop and is what run returns.
	handle func(ctx context.Context, d *delivery) error
	// stallAfter is the stall watchdog's first look after the last delivery (stallWatch); not for ordered.
	stallAfter time.Duration
	// started, when set, is called once the first pull request is at the server (pull), then cleared.
	started func()
	// closedErr is what run returns when the connection is closed under it (nil: its owner's shutdown).
	closedErr error
	// inbox is where the messages and statuses of the pull requests come, at inbox.<gen>.
	inbox string

	cons       atomic.Pointer[jetstream.Consumer]
	busy       atomic.Int32  // handlers running
	lastActive atomic.Int64  // unix nanoseconds of the last delivery or (re)opening of the consumer
	lastDeliv  atomic.Int64  // unix nanoseconds of the last delivery (or the start)
	hint       chan struct{} // to the watchdog: look soon
	reopen     chan struct{} // from the watchdog: make the consumer anew
	freed      chan error    // a handler finished, with handle's error
	opened     chan opening  // the result of open in the background (making anew)
	wg         sync.WaitGroup
	// pullsClosed is closed at shutdown once the pull subscription is gone at the server (shutdown).
	pullsClosed chan struct{}

	// Kept by run's goroutine alone.
	consName    string      // the consumer's name ("" while an ordered reader's is made anew)
	next        string      // the consumer's pull request subject
	gen         int         // the consumer's making: its requests' reply subject is inbox.<gen>
	free        int         // handlers not running
	outstanding int         // messages asked for that the server has neither delivered nor released
	queue       []*delivery // delivered, waiting for a free handler
	heard       time.Time   // the last message or heartbeat on the inbox, or the first request sent since
	lostInRow   int         // pull requests found lost since the last delivery
	holdUntil   time.Time   // no request before this (repullDelay)
	making      bool        // the consumer is being made anew: no request meanwhile
	consSeq     uint64      // ordered: the consumer sequence of the last message taken
	taken       uint64      // ordered: the stream sequence of the last message taken
}

// opening is the result of open in the background.
type opening struct {
	cons jetstream.Consumer
	err  error
}

// pullRequest is the body of a pull request (nats-server's JSApiConsumerGetNextRequest).
type pullRequest struct {
	Batch     int           `json:"batch"`
	Expires   time.Duration `json:"expires"`
	Heartbeat time.Duration `json:"idle_heartbeat"`
}

// newPullLoop is a pull loop of b's on stream with its channels made; the caller sets what it pulls for.
func (b *Bus) newPullLoop(what, name, stream string, window, handlers int) *pullLoop {
	l := &pullLoop{b: b, what: what, name: name, stream: stream, window: window, handlers: handlers,
		log: b.log.With("stream", stream, "consumer", name), inbox: b.nc.NewInbox(),
		hint: make(chan struct{}, 1), reopen: make(chan struct{}, 1), freed: make(chan error, handlers),
		opened: make(chan opening, 1), pullsClosed: make(chan struct{}), free: handlers}
	l.lastDeliv.Store(time.Now().UnixNano())
	return l
}

// start makes the consumer, then runs the loop until ctx ends or it fails.
func (l *pullLoop) start(ctx context.Context) error {
	cons, err := l.open(ctx, 0)
	if err != nil {
		return err
	}
	l.use(cons)
	return l.run(ctx)
}

// use takes cons as the consumer pulled from.
func (l *pullLoop) use(cons jetstream.Consumer) {
	l.cons.Store(&cons)
	l.consName = cons.CachedInfo().Name
	l.next = l.b.apiPrefix(l.stream) + "CONSUMER.MSG.NEXT." + l.stream + "." + l.consName
	l.lastActive.Store(time.Now().UnixNano())
}

// replyTo is the reply subject of the current consumer's requests.
func (l *pullLoop) replyTo() string { return l.inbox + "." + strconv.Itoa(l.gen) }

func (l *pullLoop) run(ctx context.Context) error {
	// run reads it at once, whatever the handlers do; a full channel would drop what comes (nats.go's slow
	// consumer), and no more than window messages are asked for at a time.
	in := make(chan *nats.Msg, 2*l.window+64)
	sub, err := l.b.nc.ChanSubscribe(l.inbox+".*", in)
	if err != nil {
		return fmt.Errorf("%s: %w", l.what, err)
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
		if !l.ordered {
			l.watch(ctx)
		}
	}()
	var loopErr error
	fail := func(err error) {
		loopErr = err
		stop()
	}
	wake := time.NewTimer(2 * l.b.pullHeartbeat) // for the heartbeats and repullDelay
	defer wake.Stop()
	l.pull(ctx)
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			continue
		case m := <-in:
			if err := l.received(ctx, m); err != nil {
				fail(err)
				continue
			}
		case err := <-l.freed:
			l.free++
			if err != nil {
				fail(err)
				continue
			}
			l.dispatch(ctx)
		case <-wake.C:
		case s, ok := <-status:
			if !ok || s == nats.CLOSED {
				fail(l.closedErr)
				continue
			}
			l.outstanding = 0 // reconnected
		case <-l.reopen:
			l.makeAnew(ctx, 0)
		case o := <-l.opened:
			l.making = false
			// A closed connection is its owner's shutdown, not the consumer's failure.
			if o.err != nil && ctx.Err() == nil && !l.b.nc.IsClosed() {
				fail(o.err) // not transient: the consumer cannot be had (permissions, a conflicting config)
				continue
			}
			if o.err == nil {
				l.use(o.cons)
			}
			// Made anew: pull at once, whatever the losses before held back.
			l.outstanding, l.holdUntil = 0, time.Time{}
		}
		now := time.Now()
		if l.outstanding > 0 && now.Sub(l.heard) >= 2*l.b.pullHeartbeat {
			l.lost(ctx, lostNoHeartbeat, nil)
		}
		l.pull(ctx)
		next := 2 * l.b.pullHeartbeat
		if l.outstanding > 0 {
			next = l.heard.Add(2 * l.b.pullHeartbeat).Sub(now)
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

// pull asks for messages unless requests are held back: up to window not yet started (asked for, or
// delivered and queued), as nats.go's iterators did, so a handler that finishes takes the next message at
// once (asking only for free handlers cost 30-40% of the throughput of 16 handlers with double acks); it asks
// again once fewer than half are left, so a busy consumer sends one request per several messages. A durable
// consumer with one handler asks only while it is free (onlyWhenFree): no message waits unstarted behind a
// running handler, so a stopping consumer holds none it must hand back, and the server holds no pull request
// of ours that a message naked by a stopping handler would be redelivered into (TestPullSurvivesRestart saw
// that third delivery).
func (l *pullLoop) pull(ctx context.Context) {
	limit := l.window
	if l.onlyWhenFree {
		limit = l.free
	}
	pending := l.outstanding + len(l.queue)
	want := limit - pending
	if want < 1 || pending >= (limit+1)/2 || l.making || time.Now().Before(l.holdUntil) {
		return
	}
	body, _ := json.Marshal(pullRequest{Batch: want, Expires: pullExpiry, Heartbeat: l.b.pullHeartbeat})
	if err := l.b.nc.PublishRequest(l.next, l.replyTo(), body); err != nil {
		if !l.b.nc.IsClosed() {
			l.lost(ctx, lostRefused, err)
		}
		return
	}
	if l.outstanding == 0 {
		l.heard = time.Now() // the heartbeats' clock starts with the request
	}
	l.outstanding += want
	l.announceStarted()
}

// startedFlushTimeout bounds the flush that tells started the first pull request reached the server.
const startedFlushTimeout = 5 * time.Second

// announceStarted calls started once a pull request was sent and the flush says the server has it (the
// inbox subscription too: it was made before on the same connection). A failed flush (the connection is
// down) leaves it for the next request sent, once this one is found lost.
func (l *pullLoop) announceStarted() {
	if l.started == nil {
		return
	}
	if err := l.b.nc.FlushTimeout(startedFlushTimeout); err != nil {
		return
	}
	started := l.started
	l.started = nil
	started()
}

// lost records a pull request found lost: what it asked for is asked again, at once or after repullDelay. An
// ordered reader's consumer is made anew from the second loss in a row, as one that took no request at all.
func (l *pullLoop) lost(ctx context.Context, reason string, err error) {
	l.outstanding = 0
	l.lostInRow++
	delay := repullDelay(l.lostInRow)
	l.holdUntil = time.Now().Add(delay)
	countLostPull(l.name, reason)
	l.log.Warn("pull request lost; pulling anew", "reason", reason, "in", delay, "lost_in_row", l.lostInRow,
		"idle", time.Since(time.Unix(0, l.lastDeliv.Load())).Round(time.Millisecond), "err", err)
	switch {
	case l.ordered && (l.lostInRow >= 2 || reason == lostNoResponders):
		l.makeAnew(ctx, delay)
	case l.lostInRow >= 2:
		// The request sent again was lost too: the consumer may be gone or without a leader, which only its
		// info tells, and only making it anew mends.
		select {
		case l.hint <- struct{}{}:
		default:
		}
	}
}

// makeAnew makes (or finds) the consumer anew in the background after delay, unless that is under way; run
// hears of it on opened, and pulls again. An ordered reader's new consumer goes on after the last message
// taken, and what the one before still sends is left unread (a reply subject of its own).
func (l *pullLoop) makeAnew(ctx context.Context, delay time.Duration) {
	if l.making || ctx.Err() != nil {
		return
	}
	l.making, l.outstanding = true, 0
	var from uint64
	if l.ordered {
		l.gen++
		l.consName, l.consSeq = "", 0
		if l.taken > 0 {
			from = l.taken + 1
		}
	}
	go func() {
		if delay > 0 {
			t := time.NewTimer(delay)
			defer t.Stop()
			select {
			case <-ctx.Done():
				l.opened <- opening{err: ctx.Err()}
				return
			case <-t.C:
			}
		}
		cons, err := l.open(ctx, from)
		l.opened <- opening{cons: cons, err: err}
	}()
}

// received takes a message of the inbox: a message for a handler, or a status of a pull request. What comes
// for an earlier consumer of an ordered reader is left: a message names its consumer in its reply subject, a
// status comes on the reply subject of the request it answers. An error ends the loop.
func (l *pullLoop) received(ctx context.Context, m *nats.Msg) error {
	status := ""
	if len(m.Data) == 0 && len(m.Header) > 0 {
		status = m.Header.Get("Status")
	}
	if status == "" {
		return l.delivered(ctx, m)
	}
	if m.Subject != l.replyTo() {
		return nil
	}
	l.heard = time.Now()
	descr := m.Header.Get("Description")
	if status == "100" { // an idle heartbeat
		if l.endWhenIdle && l.free == l.handlers && len(l.queue) == 0 {
			return errReadEnd
		}
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
		return fmt.Errorf("%s: pull request refused: %s %s", l.what, status, descr)
	case status == "503":
		l.lost(ctx, lostNoResponders, nats.ErrNoResponders)
	case status == "409" && strings.Contains(d, "leadership change"):
		l.lost(ctx, lostLeaderChanged, nil)
	case status == "409" && strings.Contains(d, "consumer deleted"):
		countLostPull(l.name, lostConsumerDeleted)
		l.log.Warn("consumer deleted; making it anew")
		l.makeAnew(ctx, 0)
	default:
		l.lost(ctx, lostRefused, fmt.Errorf("%s %s", status, descr))
	}
	return nil
}

// delivered queues a delivered message for the handlers; an ordered reader's must follow the one before.
func (l *pullLoop) delivered(ctx context.Context, m *nats.Msg) error {
	d, err := newDelivery(l.b.nc, m)
	if err != nil {
		l.heard = time.Now()
		l.outstanding = max(l.outstanding-1, 0)
		l.log.Warn("delivery without its metadata; left to be redelivered", "subject", m.Subject, "err", err)
		return nil
	}
	if l.ordered && d.consumer != l.consName {
		return nil // an earlier consumer's
	}
	l.heard = time.Now()
	l.outstanding = max(l.outstanding-1, 0)
	if l.ordered {
		if d.consumerSeq != l.consSeq+1 {
			countLostPull(l.name, lostSequenceGap)
			l.log.Warn("ordered delivery skipped a message; making the consumer anew", "after_stream_seq", l.taken,
				"consumer_seq", d.consumerSeq, "want_consumer_seq", l.consSeq+1)
			l.makeAnew(ctx, 0)
			return nil
		}
		l.consSeq, l.taken = d.consumerSeq, d.streamSeq
	}
	now := time.Now().UnixNano()
	l.lastActive.Store(now)
	l.lastDeliv.Store(now)
	l.lostInRow, l.holdUntil = 0, time.Time{}
	l.queue = append(l.queue, d)
	l.dispatch(ctx)
	return nil
}

// dispatch starts queued messages on free handlers, in the order they came.
func (l *pullLoop) dispatch(ctx context.Context) {
	for l.free > 0 && len(l.queue) > 0 && ctx.Err() == nil {
		d := l.queue[0]
		l.queue = l.queue[1:]
		l.free--
		l.busy.Add(1)
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			err := l.handle(ctx, d)
			l.busy.Add(-1)
			l.freed <- err
		}()
	}
}

// shutdown hands back what was delivered but not started (an ordered reader drops it) once the pull
// subscription is gone at the server (drained: its unsubscribe went out before the naks, on the same
// connection), so the server cannot redeliver a message into a pull request of this stopping consumer, which
// would hand it back again and spend one more of its MaxDeliver deliveries; then it waits for the handlers
// and a making anew under way.
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
	if !l.ordered {
		for _, d := range handBack {
			_ = d.nak(0)
		}
	}
	l.wg.Wait()
	if l.making {
		<-l.opened
	}
}

// watch is the stall watchdog of a durable consumer: on stallWatch's schedule it looks at the consumer's info
// and has run make the consumer anew when the server holds no pull request of ours while a handler is free,
// when messages wait and none is delivered, or when the consumer does not answer.
func (l *pullLoop) watch(ctx context.Context) {
	t := time.NewTicker(max(l.stallAfter/3, 10*time.Millisecond))
	defer t.Stop()
	w := newStallWatch(l.stallAfter, time.Now())
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
		room := int(l.busy.Load()) < l.handlers
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
		countLostPull(l.name, lostWatchdog)
		l.lastActive.Store(time.Now().UnixNano())
		select {
		case l.reopen <- struct{}{}:
		default: // one is already asked for
		}
	}
}

// delivery is a message a consumer delivered, acked on its reply subject:
// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>, or with the domain and
// the account hash after ACK and a token more at the end.
type delivery struct {
	nc                      *nats.Conn
	m                       *nats.Msg
	consumer                string
	numDelivered, streamSeq uint64
	consumerSeq             uint64
	time                    time.Time
	pending                 uint64 // messages of the consumer's filter after this one when it was delivered
}

func newDelivery(nc *nats.Conn, m *nats.Msg) (*delivery, error) {
	tokens := strings.Split(m.Reply, ".")
	if len(tokens) < 9 || tokens[0] != "$JS" || tokens[1] != "ACK" || len(tokens) == 10 {
		return nil, fmt.Errorf("ack subject %q", m.Reply)
	}
	if len(tokens) > 9 {
		tokens = append(tokens[:2:2], tokens[4:]...) // the domain and the account hash out
	}
	var nums [5]uint64 // delivered, stream seq, consumer seq, time, pending
	var errs []error
	for i := range nums {
		n, err := strconv.ParseUint(tokens[4+i], 10, 64)
		nums[i], errs = n, append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("ack subject %q: %w", m.Reply, err)
	}
	return &delivery{nc: nc, m: m, consumer: tokens[3], numDelivered: nums[0], streamSeq: nums[1], consumerSeq: nums[2],
		time: time.Unix(0, int64(nums[3])), pending: nums[4]}, nil
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
