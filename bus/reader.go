package bus

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// StopReading is what a Read callback returns to end the read there: Read then returns nil.
var StopReading = errors.New("stop reading")

// errReadEnd ends a read to the end of the stream once it got there (Read returns nil).
var errReadEnd = errors.New("end of the stream")

// ReadOption configures Read.
type ReadOption func(*readConfig)

type readConfig struct {
	from     uint64
	follow   bool
	onStart  func(pending uint64)
	retryFor time.Duration
	retrySet bool
}

// From starts the read at stream sequence seq (0, the default: the first message). ^uint64(0) reads only the
// messages stored after the reader's consumer is made (DeliverNew).
func From(seq uint64) ReadOption { return func(c *readConfig) { c.from = seq } }

// Follow keeps reading the messages stored after the end, until ctx ends or the callback fails. Without it
// Read stops at the end of the stream as of the call.
func Follow() ReadOption { return func(c *readConfig) { c.follow = true } }

// OnStart has fn called, before any message, with how many messages matching the filter the stream held from
// the start position on when the reader's consumer was made: 0 means the reader is caught up before any
// message arrives. It is called once per Read, not when the consumer is made anew inside it.
func OnStart(fn func(pending uint64)) ReadOption { return func(c *readConfig) { c.onStart = fn } }

// RetryFor bounds how long making the reader's consumer (and, reading to the end, looking at the stream)
// may fail transiently before Read returns the error; 0 retries until ctx ends. The default is 20 s reading
// to the end, and 0 with Follow.
func RetryFor(d time.Duration) ReadOption {
	return func(c *readConfig) { c.retryFor, c.retrySet = d, true }
}

// tailWindow is how many messages a reader asks for ahead of its callback.
const tailWindow = 2048

// tailInactive is how long the server keeps a reader's consumer that nobody pulls from (nats.go's ordered
// consumer's): the consumers a reader leaves behind (one made anew, one of a Read that returned) go then; a
// node may make them, not delete them.
const tailInactive = 5 * time.Minute

// Read delivers the messages of stream matching filter ("": all) in stream order to fn, from the first one
// (or From), until the end of the stream as of the call (or, with Follow, until ctx ends). It returns nil
// once the end is read, when fn returns StopReading, or (with Follow) when ctx ends; an error fn returns
// is returned as is; a read to the end that ctx cuts short returns an error wrapping ctx's. A closed
// connection is returned (wrapped) so the caller resumes from its position. fn runs on the caller's
// goroutine, one message at a time.
//
// It reads with an ordered consumer: no acks and no server-side state, the caller keeps its own position
// (the last sequence fn accepted) and resumes from it after an error or a restart. The reader pulls with the
// loop Consume uses (pullLoop), its consumer made anew when a delivery skips a message or no server takes its
// requests: nats.go's iterators lost pull requests as they did for Consume, and noticed only after two missed
// 5 s heartbeats; here a lost request is sent again within 2 s (TestReadNoticesALostPull). The loop's lost
// pull requests are counted as imagefleet_bus_pulls_lost_total{consumer="tail:<stream>"}.
func (b *Bus) Read(ctx context.Context, stream, filter string, fn func(StreamMsg) error, opts ...ReadOption) error {
	var cfg readConfig
	for _, o := range opts {
		o(&cfg)
	}
	if !cfg.retrySet && !cfg.follow {
		cfg.retryFor = kvRetryFor
	}
	what := "read " + stream
	if cfg.follow {
		what = "tail " + stream
	}
	// Read to the end: the end is the stream's last message as of the call, or a delivery that leaves none
	// of the filter's pending.
	var stopSeq uint64
	if !cfg.follow {
		var info *jetstream.StreamInfo
		err := b.retryTransientFor(ctx, "stream "+stream, cfg.retryFor, func(actx context.Context) error {
			s, err := b.js.Stream(actx, stream)
			if err != nil {
				return fmt.Errorf("stream %s: %w", stream, err)
			}
			info, err = s.Info(actx)
			if err != nil {
				return fmt.Errorf("stream %s info: %w", stream, err)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if info.State.Msgs == 0 {
			if cfg.onStart != nil {
				cfg.onStart(0)
			}
			return nil
		}
		stopSeq = info.State.LastSeq
	}
	name := "tail:" + stream
	initLostPullMetrics(name)
	l := b.newPullLoop(what, name, stream, tailWindow, 1)
	l.log = l.log.With("filter", filter)
	l.ordered = true
	l.endWhenIdle = !cfg.follow
	l.closedErr = fmt.Errorf("%s: %w", what, nats.ErrConnectionClosed)
	l.open = func(ctx context.Context, from uint64) (jetstream.Consumer, error) {
		cc := jetstream.ConsumerConfig{
			Name:              "tail_" + rand.Text(),
			DeliverPolicy:     jetstream.DeliverAllPolicy,
			AckPolicy:         jetstream.AckNonePolicy,
			InactiveThreshold: tailInactive,
			Replicas:          1,
			MemoryStorage:     true,
			FilterSubject:     filter,
		}
		if from == 0 {
			from = cfg.from
		}
		switch {
		case from == ^uint64(0):
			cc.DeliverPolicy = jetstream.DeliverNewPolicy
		case from > 0:
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from
		}
		// Each attempt has a context of its own: a create whose reply was lost with a server is asked again
		// after AttemptTimeout instead of holding the caller until its deadline.
		var cons jetstream.Consumer
		err := b.retryTransientFor(ctx, what, cfg.retryFor, func(actx context.Context) (err error) {
			cons, err = b.js.CreateConsumer(actx, stream, cc)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		return cons, nil
	}
	// fn runs on the caller's goroutine, as a callback of a plain loop would (a test's t.Fatal in it ends the
	// test, not a goroutine of the loop's): the loop's handler hands each message over and waits for fn's
	// answer, or for the loop's end.
	calls := make(chan StreamMsg)
	answers := make(chan error, 1)
	l.handle = func(hctx context.Context, d *delivery) error {
		m := StreamMsg{Subject: d.m.Subject, Header: d.m.Header, Data: d.m.Data, Seq: d.streamSeq, Time: d.time,
			Pending: d.pending, Origin: originSeq(d.m.Header.Get(headerStreamSource))}
		select {
		case calls <- m:
		case <-hctx.Done():
			return nil
		}
		select {
		case err := <-answers:
			return err
		case <-hctx.Done():
			return nil
		}
	}
	cons, err := l.open(ctx, 0)
	if err != nil {
		if ctx.Err() != nil && cfg.follow {
			return nil
		}
		return err
	}
	pending := cons.CachedInfo().NumPending
	if cfg.onStart != nil {
		cfg.onStart(pending)
	}
	if !cfg.follow && pending == 0 {
		return nil
	}
	l.use(cons)
	// Ended when Read returns, whichever way (fn's Goexit or panic included): the loop then stops.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- l.run(rctx) }()
	for running := true; running; {
		select {
		case m := <-calls:
			aerr := fn(m)
			if aerr == nil && !cfg.follow && (m.Seq >= stopSeq || m.Pending == 0) {
				aerr = errReadEnd
			}
			answers <- aerr // never blocks: one message at a time, its handler waiting (or gone with the loop)
		case err = <-done:
			running = false
		}
	}
	switch {
	case errors.Is(err, StopReading), errors.Is(err, errReadEnd):
		return nil
	case err == nil && !cfg.follow && ctx.Err() != nil:
		return fmt.Errorf("%s: %w", what, ctx.Err())
	}
	return err
}

// headerStreamSource is the header the server adds to a message it copies into a stream that sources
// another: "<stream> <seq> <filter> <transform>".
const headerStreamSource = "Nats-Stream-Source"

// originSeq is the origin stream's sequence in a Nats-Stream-Source header ("<stream> <seq> <filter>
// <transform> ..."), 0 when there is none.
func originSeq(h string) uint64 {
	f := strings.Fields(h)
	if len(f) < 2 {
		return 0
	}
	n, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// CountPending is how many messages of stream matching filter it holds from startSeq (0: the first) on. It
// makes a consumer that delivers nothing and is left to expire (a node identity may create consumers with
// its own filter, not delete them).
func (b *Bus) CountPending(ctx context.Context, stream, filter string, startSeq uint64) (uint64, error) {
	cc := jetstream.ConsumerConfig{
		Name:              "count-" + rand.Text(),
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		InactiveThreshold: 5 * time.Second,
		FilterSubject:     filter,
	}
	if startSeq > 0 {
		cc.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cc.OptStartSeq = startSeq
	}
	c, err := b.js.CreateConsumer(ctx, stream, cc)
	if err != nil {
		return 0, fmt.Errorf("count %s in %s: %w", filter, stream, err)
	}
	return c.CachedInfo().NumPending, nil
}
