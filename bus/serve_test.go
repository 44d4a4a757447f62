package bus_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestRemoteErrorsCarryTheirCode: a handler's error that wraps a sentinel of events' code table reaches the
// requester as that sentinel (by the reply's error-code header) with its text unchanged; any other error is
// a plain remote error.
func TestRemoteErrorsCarryTheirCode(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errs := map[string]error{
		"malformed":  fmt.Errorf("decode request: %w: bad field", events.ErrMalformed),
		"catchingup": fmt.Errorf("%w (applied up to 3)", events.ErrIndexCatchingUp),
		"plain":      errors.New("the index is catching up with its events, says the text"),
	}
	// Listen returns once the server holds the subscription: no request below can find no responders.
	l, err := b.Listen(ctx, "t.codes.*", "", 1, func(_ context.Context, data []byte) (any, error) {
		return nil, errs[string(data)]
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ctx) }()
	for name, want := range map[string]error{"malformed": events.ErrMalformed, "catchingup": events.ErrIndexCatchingUp, "plain": nil} {
		err := b.Request(t.Context(), "t.codes."+name, []byte(name), nil)
		if !errors.Is(err, bus.ErrRemote) || err.Error() != "remote error: "+errs[name].Error() {
			t.Errorf("%s: err = %v, want the remote error with its text", name, err)
		}
		for _, sentinel := range []error{events.ErrMalformed, events.ErrIndexCatchingUp} {
			if errors.Is(err, sentinel) != (sentinel == want) {
				t.Errorf("%s: errors.Is(err, %v) = %v", name, sentinel, !(sentinel == want))
			}
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestHandlerReadsTheRequestSubject: a handler served on a wildcard reads the subject each request came on
// from its ctx, whatever the body says; outside a request the subject is empty.
func TestHandlerReadsTheRequestSubject(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	l, err := b.Listen(ctx, "t.subject.*", "q", 2, func(ctx context.Context, _ []byte) (any, error) {
		return bus.RequestSubject(ctx), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ctx) }()
	for _, subject := range []string{"t.subject.n1", "t.subject.n2"} {
		var got string
		if err := b.Request(t.Context(), subject, []byte(`"t.subject.n3"`), &got); err != nil || got != subject {
			t.Errorf("request on %s: handler saw subject %q, err %v", subject, got, err)
		}
	}
	if got := bus.RequestSubject(t.Context()); got != "" {
		t.Errorf("outside a request: subject %q, want none", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestRequestDecodesEachReplyAfresh: a retry loop that decodes every attempt into one variable sees what the
// last reply holds, not what an earlier one left: fields the reply omits (omitempty, here GCResult's error)
// are zero, and a reply with no data leaves resp zero.
func TestRequestDecodesEachReplyAfresh(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// The third call is refused: an error reply, which leaves the second reply in place.
	replies := []any{events.GCResult{Node: "n", Error: "list images: connection refused"}, events.GCResult{Node: "n"}, nil, nil}
	calls := 0
	l, err := b.Listen(ctx, "t.afresh", "", 1, func(context.Context, []byte) (any, error) {
		r := replies[calls%len(replies)]
		calls++
		if calls == 3 {
			return nil, errors.New("refused")
		}
		return r, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ctx) }()
	var res events.GCResult
	for i, want := range []events.GCResult{{Node: "n", Error: "list images: connection refused"}, {Node: "n"}, {Node: "n"}, {}} {
		err := b.Request(t.Context(), "t.afresh", nil, &res)
		if i == 2 {
			if !errors.Is(err, bus.ErrRemote) {
				t.Fatalf("reply 3: %v, want an error reply", err)
			}
		} else if err != nil {
			t.Fatal(err)
		}
		if res.Node != want.Node || res.Error != want.Error {
			t.Errorf("reply %d decoded as node %q error %q, want node %q error %q", i+1, res.Node, res.Error, want.Node, want.Error)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestSubscribeSyncHoldsABoundedBurst: a synchronous subscription holds bus.SyncQueueLen messages unread; the
// next one is dropped, and the next read says so (a slow consumer), so a worker knows it missed some. The
// bound is what keeps each subscription's buffer small (nats.go's default holds 65,536).
func TestSubscribeSyncHoldsABoundedBurst(t *testing.T) {
	srv, b := bustest.Start(t)
	sub, err := b.SubscribeSync(t.Context(), "test.burst")
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	pub := bustest.Connect(t, srv)
	for i := range bus.SyncQueueLen + 1 {
		if err := pub.PublishRaw("test.burst", []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	fctx, fcancel := context.WithTimeout(t.Context(), bustest.Timeout)
	defer fcancel()
	if err := pub.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	// Every message has reached the subscriber once a round trip of its own connection has: the server
	// delivered them in order before the pong.
	if err := b.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	var slow error
	for i := range bus.SyncQueueLen + 1 {
		ctx, cancel := context.WithTimeout(t.Context(), bustest.Timeout)
		_, data, err := sub.Next(ctx)
		cancel()
		if err != nil {
			slow = err
			break
		}
		if string(data) != strconv.Itoa(i) {
			t.Fatalf("message %d reads %q", i, data)
		}
	}
	if !errors.Is(slow, nats.ErrSlowConsumer) {
		t.Fatalf("after a burst of %d, reading gave %v; want a slow consumer error", bus.SyncQueueLen+1, slow)
	}
}
