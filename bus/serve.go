package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/events"
)

// Handler answers one request: what it returns is marshalled into the reply's data; an error becomes the
// reply's error text. A handler must not panic on any input; Serve recovers anyway and answers with an error.
// The subject the request came on is RequestSubject(ctx).
type Handler func(ctx context.Context, data []byte) (any, error)

// subjectKey is the context key of the request's subject.
type subjectKey struct{}

// RequestSubject is the subject of the request a Handler is answering ("" outside one: a handler called
// directly). A handler served on a wildcard reads the token the server routed on here, not in the body: the
// server's permissions checked who may publish on the subject, while the body says whatever its sender wrote.
func RequestSubject(ctx context.Context) string {
	s, _ := ctx.Value(subjectKey{}).(string)
	return s
}

// WithRequestSubject is ctx as a Handler sees it when answering a request on subject (for tests that call a
// handler directly).
func WithRequestSubject(ctx context.Context, subject string) context.Context {
	return context.WithValue(ctx, subjectKey{}, subject)
}

// Serve answers requests on subject in queue group queue (replicas share the load) until ctx ends.
// Requests are handled one at a time per subscription, in order; use ServeConcurrent for parallel handlers.
func (b *Bus) Serve(ctx context.Context, subject, queue string, h Handler) error {
	return b.ServeConcurrent(ctx, subject, queue, 1, h)
}

// ServeConcurrent is Serve with up to n handlers running at once.
func (b *Bus) ServeConcurrent(ctx context.Context, subject, queue string, n int, h Handler) error {
	l, err := b.Listen(ctx, subject, queue, n, h)
	if err != nil {
		return err
	}
	return l.Serve(ctx)
}

// Listener is a subscription that answers requests once Serve runs. Its interest is registered at the
// server when Listen returns, so a worker that listens on every subject before it says ready is ready to
// answer: a request sent after that finds a responder on this server (a cluster spreads the interest to its
// other servers asynchronously, a route round trip later).
type Listener struct {
	b      *Bus
	n      int
	answer func(ctx context.Context, m *nats.Msg)
	ch     chan *nats.Msg
	sub    *nats.Subscription
}

// Listen subscribes to subject in queue group queue ("" for none) for up to n handlers at once, and flushes,
// so the server holds the interest when it returns. Requests that arrive before Serve wait in the
// subscription's buffer.
func (b *Bus) Listen(ctx context.Context, subject, queue string, n int, h Handler) (*Listener, error) {
	log := b.log.With("subject", subject)
	l, err := b.listen(ctx, subject, queue, n, func(ctx context.Context, m *nats.Msg) { b.answer(ctx, log, m, h) })
	if err != nil {
		return nil, err
	}
	initServedMetrics(subject)
	return l, nil
}

// listen subscribes and flushes for Listen and RespondListen; answer handles one request.
func (b *Bus) listen(ctx context.Context, subject, queue string, n int, answer func(context.Context, *nats.Msg)) (*Listener, error) {
	ch := make(chan *nats.Msg, 256)
	sub, err := b.nc.ChanQueueSubscribe(subject, queue, ch)
	inner := answer
	answer = func(ctx context.Context, m *nats.Msg) {
		if !refuseDelivered(b.log, m) {
			inner(ctx, m)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subject, err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.nc.FlushWithContext(fctx); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("subscribe %s: flush: %w", subject, err)
	}
	return &Listener{b: b, n: max(n, 1), answer: answer, ch: ch, sub: sub}, nil
}

// Serve answers requests until ctx ends, then unsubscribes and flushes (the server has dropped the interest
// when it returns, so a request sent after finds no responder here); it returns nil.
func (l *Listener) Serve(ctx context.Context) error {
	var wg sync.WaitGroup
	for range l.n {
		wg.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case m := <-l.ch:
					l.answer(ctx, m)
				}
			}
		})
	}
	<-ctx.Done()
	_ = l.sub.Unsubscribe()
	wg.Wait()
	if l.b.nc.IsConnected() {
		fctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = l.b.nc.FlushWithContext(fctx)
	}
	return nil
}

// Close unsubscribes a listener that will not Serve (a worker whose start failed after Listen).
func (l *Listener) Close() { _ = l.sub.Unsubscribe() }

func (b *Bus) answer(ctx context.Context, log *slog.Logger, m *nats.Msg, h Handler) {
	if m.Reply == "" {
		return
	}
	var rep events.Reply
	out, err := safeHandle(WithRequestSubject(ctx, m.Subject), h, m.Data)
	countServed(subjectOf(m), err != nil)
	code := ""
	if err != nil {
		rep.Error = err.Error()
		code = events.ErrorCode(err)
	} else if out != nil {
		raw, mErr := json.Marshal(out)
		if mErr != nil {
			rep.Error = fmt.Sprintf("marshal reply: %v", mErr)
		} else {
			rep.Data = raw
		}
	}
	body, _ := json.Marshal(rep)
	if len(body) > int(b.nc.MaxPayload()) {
		body, _ = json.Marshal(events.Reply{Error: fmt.Sprintf("reply of %d bytes is over the server's max payload %d; ask for less (limit)", len(body), b.nc.MaxPayload())})
	}
	reply := &nats.Msg{Subject: m.Reply, Data: body}
	if code != "" {
		reply.Header = nats.Header{events.HeaderErrorCode: []string{code}}
	}
	if err := m.RespondMsg(reply); err != nil {
		log.Warn("respond failed", "err", err)
	}
}

func safeHandle(ctx context.Context, h Handler, data []byte) (out any, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("internal error handling request: %v", r)
		}
	}()
	return h(ctx, data)
}

// ErrRemote is wrapped by Request when the responder answered with an error.
var ErrRemote = errors.New("remote error")

// remoteError is an error reply: its text is the responder's, and it wraps ErrRemote and the sentinel of
// the reply's error code (events.CodeError), so callers classify it by code, not by text.
type remoteError struct {
	text string
	code error // nil when the reply carries no known code
}

func (e *remoteError) Error() string { return ErrRemote.Error() + ": " + e.text }

func (e *remoteError) Unwrap() []error {
	if e.code == nil {
		return []error{ErrRemote}
	}
	return []error{ErrRemote, e.code}
}

// ErrNoResponders means nobody serves the subject (the worker is not running).
var ErrNoResponders = errors.New("no responders")

// Request sends req (marshalled as JSON; a []byte is sent as is) to subject and decodes the reply's data into
// resp (which may be nil). resp is zeroed before, so it holds this reply only: a retry loop that decodes each
// attempt into one variable does not keep a field an earlier reply set and this one omits. An error reply
// is returned as an error wrapping ErrRemote with the remote text, and leaves resp as it was; a reply whose
// data does not decode into resp is an error, and leaves resp zeroed or partly filled.
func (b *Bus) Request(ctx context.Context, subject string, req any, resp any) error {
	var data []byte
	switch v := req.(type) {
	case nil:
	case []byte:
		data = v
	default:
		var err error
		if data, err = json.Marshal(req); err != nil {
			return fmt.Errorf("marshal request for %s: %w", subject, err)
		}
	}
	m, err := b.nc.RequestWithContext(ctx, subject, data)
	if err != nil {
		if errors.Is(err, nats.ErrNoResponders) {
			return fmt.Errorf("request %s: %w (is the worker running?)", subject, ErrNoResponders)
		}
		return fmt.Errorf("request %s: %w", subject, b.explainPermission(subject, err))
	}
	data, err = replyData(subject, m)
	if err != nil {
		return err
	}
	if v := reflect.ValueOf(resp); v.Kind() == reflect.Pointer && !v.IsNil() {
		v.Elem().SetZero()
	}
	if resp != nil && len(data) > 0 {
		if err := json.Unmarshal(data, resp); err != nil {
			return fmt.Errorf("decode reply data from %s: %w", subject, err)
		}
	}
	return nil
}

// replyData opens a reply's envelope (events.Reply): its data, or its error as one wrapping ErrRemote.
func replyData(subject string, m *nats.Msg) (json.RawMessage, error) {
	var rep events.Reply
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		return nil, fmt.Errorf("decode reply from %s: %w", subject, err)
	}
	if rep.Error != "" {
		return nil, &remoteError{text: rep.Error, code: events.CodeError(m.Header.Get(events.HeaderErrorCode))}
	}
	return rep.Data, nil
}

// Gather sends data to subject once, with no queue group, and passes every reply to fn, decoded as
// Request decodes one (an error reply as an error wrapping ErrRemote), until fn returns false or ctx ends.
// It returns nil when fn stopped it, ErrNoResponders when nobody serves the subject, and ctx's error when
// the replies did not satisfy fn in time: a scatter and gather, for workers that each hold a part.
func (b *Bus) Gather(ctx context.Context, subject string, data []byte, fn func(data []byte, err error) bool) error {
	inbox := b.nc.NewInbox()
	sub, err := b.nc.SubscribeSync(inbox)
	if err != nil {
		return fmt.Errorf("gather %s: subscribe: %w", subject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	msg := &nats.Msg{Subject: subject, Reply: inbox, Data: data}
	if err := b.nc.PublishMsg(msg); err != nil {
		return fmt.Errorf("gather %s: %w", subject, b.explainPermission(subject, err))
	}
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return fmt.Errorf("gather %s: %w", subject, err)
		}
		if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
			return fmt.Errorf("gather %s: %w (is the worker running?)", subject, ErrNoResponders)
		}
		if !fn(replyData(subject, m)) {
			return nil
		}
	}
}

// RequestRaw sends data and returns the raw reply envelope (for tests of malformed input).
func (b *Bus) RequestRaw(ctx context.Context, subject string, data []byte) (events.Reply, error) {
	m, err := b.nc.RequestWithContext(ctx, subject, data)
	if err != nil {
		return events.Reply{}, fmt.Errorf("request %s: %w", subject, err)
	}
	var rep events.Reply
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		return events.Reply{}, fmt.Errorf("decode reply from %s: %w", subject, err)
	}
	return rep, nil
}

// Subscribe delivers core NATS messages on subject (no queue group) to fn, with their headers, until ctx
// ends.
func (b *Bus) Subscribe(ctx context.Context, subject string, fn func(subject string, header map[string][]string, data []byte)) error {
	sub, err := b.nc.Subscribe(subject, func(m *nats.Msg) {
		if !refuseDelivered(b.log, m) {
			fn(m.Subject, m.Header, m.Data)
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", subject, err)
	}
	<-ctx.Done()
	return sub.Unsubscribe()
}

// Subscription is a synchronous core NATS subscription: it is registered at the server when Subscribe
// returns, so a request published afterwards cannot race its answer.
type Subscription struct {
	sub *nats.Subscription
	log *slog.Logger
}

// SubscribeSync subscribes to subject (no queue group) and flushes, so the server knows the interest before
// the caller publishes anything.
func (b *Bus) SubscribeSync(ctx context.Context, subject string) (*Subscription, error) {
	sub, err := b.nc.SubscribeSync(subject)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subject, err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.nc.FlushWithContext(fctx); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("subscribe %s: flush: %w", subject, err)
	}
	return &Subscription{sub: sub, log: b.log}, nil
}

// Next waits for the next message until ctx ends.
func (s *Subscription) Next(ctx context.Context) (subject string, data []byte, err error) {
	m, err := s.next(ctx)
	if err != nil {
		return "", nil, err
	}
	return m.Subject, m.Data, nil
}

// NextMsg waits for the next message until ctx ends, with its headers.
func (s *Subscription) NextMsg(ctx context.Context) (subject string, header map[string][]string, data []byte, err error) {
	m, err := s.next(ctx)
	if err != nil {
		return "", nil, nil, err
	}
	return m.Subject, m.Header, m.Data, nil
}

// next returns the next message a client published (one a push consumer delivered is dropped).
func (s *Subscription) next(ctx context.Context) (*nats.Msg, error) {
	for {
		m, err := s.sub.NextMsgWithContext(ctx)
		if err != nil || !refuseDelivered(s.log, m) {
			return m, err
		}
	}
}

// Close unsubscribes.
func (s *Subscription) Close() { _ = s.sub.Unsubscribe() }

// Each calls fn for each message until ctx ends. After an error (messages dropped as a slow consumer, the
// connection closed) it calls onErr, when set, and waits a second before reading on, so a subscription that
// fails at once is not spun on.
func (s *Subscription) Each(ctx context.Context, onErr func(error), fn func(subject string, header map[string][]string, data []byte)) {
	for {
		subject, header, data, err := s.NextMsg(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if onErr != nil {
				onErr(err)
			}
			t := time.NewTimer(time.Second)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		fn(subject, header, data)
	}
}

// Notify calls fn once for each message until ctx ends, for a worker that only needs to know that something
// happened (refresh, check now). After an error (messages dropped as a slow consumer, the connection closed)
// it waits a second and calls fn anyway: a message may have been lost, and a subscription that fails at once
// is not spun on.
func (s *Subscription) Notify(ctx context.Context, fn func()) {
	for {
		_, err := s.next(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
		fn()
	}
}
