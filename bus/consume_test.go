package bus_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestConsumeOneAtATimeNeverStalls: a consumer handling one message at a time goes through a backlog without
// a pause. nats.go v1.55.0's iterators skip a pull request asked for while their pull goroutine has not yet
// marked the previous one sent; with the previous one (one message) already answered, nothing was left at
// the server to wake them, and the consumer sat idle until two heartbeats were missed (30 s):
// TestForeignRemovals's stall in CI, 2 runs in 3 under -race. Short waits after each delivery narrowed the
// gap; with nats.go's Consume and 1 s heartbeats one message in fifty waited 2 s under -race. The pull loop
// now sends its own requests. The watchdog is out of the way (StallAfter an hour), so only the pull loop
// itself is measured.
func TestConsumeOneAtATimeNeverStalls(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	const n = 2000
	for i := range n {
		raw, _ := json.Marshal(i)
		if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
	var handled, last atomic.Int64
	last.Store(time.Now().UnixNano())
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "c", Concurrency: 1, MaxAckPending: 256, StallAfter: time.Hour},
			func(context.Context, *bus.Msg) error {
				handled.Add(1)
				last.Store(time.Now().UnixNano())
				return nil
			})
	}()
	// A pause of 10 s is a stall (the healthy loop hands out a message every few milliseconds, even under
	// -race on a loaded machine); the stall lasts 30 s.
	for handled.Load() < n {
		if idle := time.Since(time.Unix(0, last.Load())); idle > 10*time.Second {
			st, err := b.Consumer(ctx, "T", "c")
			t.Fatalf("stalled after %d of %d messages: none handled for %v; consumer %+v %v", handled.Load(), n, idle.Round(time.Second), st, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestConsumeStoppingHandsBackOnce: a consumer stopped while its handler runs hands the message back once:
// the next consumer gets it as its second delivery, not its third. The stopping consumer naks only after its
// pull subscription is gone, so the server cannot redeliver the nak'ed message into a pull request of the
// stopping consumer (which would hand it back again and spend a delivery of MaxDeliver):
// TestPullSurvivesRestart's Deliveries 3.
func TestConsumeStoppingHandsBackOnce(t *testing.T) {
	for _, conc := range []int{1, 4} {
		t.Run(fmt.Sprintf("concurrency=%d", conc), func(t *testing.T) {
			_, b := bustest.Start(t)
			if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}, WorkQueue: true}); err != nil {
				t.Fatal(err)
			}
			cfg := bus.ConsumerConfig{Stream: "T", Durable: "c", Concurrency: conc, MaxAckPending: conc}
			for range 5 {
				raw, _ := json.Marshal("job")
				if _, err := b.PublishCommand(t.Context(), "t.x", "", json.RawMessage(raw), nil); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(t.Context())
				started := make(chan struct{}, 1)
				done := make(chan error, 1)
				go func() {
					done <- b.Consume(ctx, cfg, func(ctx context.Context, m *bus.Msg) error {
						started <- struct{}{}
						<-ctx.Done()
						return ctx.Err()
					})
				}()
				<-started
				cancel()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				got := make(chan uint64, 1)
				ctx, cancel = context.WithCancel(t.Context())
				go func() {
					done <- b.Consume(ctx, cfg, func(ctx context.Context, m *bus.Msg) error {
						got <- m.NumDelivered
						return nil
					})
				}()
				select {
				case d := <-got:
					if d != 2 {
						t.Errorf("the next consumer got delivery %d, want 2 (one hand-back)", d)
					}
				case <-time.After(time.Minute):
					t.Fatal("the message never came back")
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// lostPulls is imagefleet_bus_pulls_lost_total{consumer,reason}.
func lostPulls(t *testing.T, consumer, reason string) float64 {
	t.Helper()
	v, _ := series(t, "imagefleet_bus_pulls_lost_total", map[string]string{"consumer": consumer, "reason": reason})
	return v
}

// TestConsumeNoticesALostPull: a pull request that no server holds is noticed within seconds, counted,
// logged and sent again. The consumer is deleted while its handler runs (no request of ours waits then),
// so the request sent after the handler reaches no consumer: a plain subscriber on the consumer's pull
// subject (the spy) takes it instead, as nothing answers a request sent while a consumer is made anew or
// elects a leader. The consumer is then made again, with a message pending. nats.go's iterator counted
// such a request as waiting until two heartbeats were missed (2x15 s), and the stall watchdog looked
// StallAfter (15 s) after the last delivery and pulled anew 5-10 s later: 25-30 s before the message came.
func TestConsumeNoticesALostPull(t *testing.T) {
	srv := bustest.Server(t)
	var logs bustest.SyncBuffer
	b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{Name: t.Name(), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	spy, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer spy.Close()
	pulls := make(chan *nats.Msg, 64)
	if _, err := spy.ChanSubscribe("$JS.API.CONSUMER.MSG.NEXT.T.lost", pulls); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	before := lostPulls(t, "lost", "no_heartbeat")
	cfg := bus.ConsumerConfig{Stream: "T", Durable: "lost", Concurrency: 1, MaxAckPending: 256}
	delivered := make(chan time.Time, 16)
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		first := true
		done <- b.Consume(ctx, cfg, func(ctx context.Context, m *bus.Msg) error {
			delivered <- time.Now()
			if first {
				first = false
				<-release
			}
			return nil
		})
	}()
	if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(`1`), nil); err != nil {
		t.Fatal(err)
	}
	<-delivered
	for _, reason := range []string{"no_heartbeat", "no_responders", "leader_changed", "consumer_deleted", "refused", "watchdog"} {
		if _, ok := series(t, "imagefleet_bus_pulls_lost_total", map[string]string{"consumer": "lost", "reason": reason}); !ok {
			t.Errorf("imagefleet_bus_pulls_lost_total{consumer=lost,reason=%s} is not exported", reason)
		}
	}
	if err := b.Request(ctx, "$JS.API.CONSUMER.DELETE.T.lost", nil, nil); err != nil {
		t.Fatal(err)
	}
	for len(pulls) > 0 {
		<-pulls
	}
	close(release)
	bustest.WaitWithin(t, "the pull request sent while the consumer was away", 10*time.Second, func() bool { return len(pulls) > 0 })
	lostAt := time.Now()
	if err := b.EnsureConsumer(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	// The stream's message is pending for the consumer made anew: it comes once a pull request is sent.
	select {
	case at := <-delivered:
		// Two missed heartbeats (2 s) and the time to send the request anew; 25-30 s before.
		if d := at.Sub(lostAt); d > 5*time.Second {
			t.Fatalf("delivered %v after the pull request was lost, want the lost request noticed and sent again within a few seconds", d.Round(time.Millisecond))
		}
	case <-time.After(time.Minute):
		t.Fatal("nothing delivered within a minute of the pull request lost")
	}
	if n := lostPulls(t, "lost", "no_heartbeat") - before; n < 1 {
		t.Errorf("imagefleet_bus_pulls_lost_total{reason=no_heartbeat} rose by %v, want at least 1", n)
	}
	if l := logs.String(); !strings.Contains(l, "pull request lost; pulling anew") || !strings.Contains(l, "reason=no_heartbeat") {
		t.Errorf("no log line of the lost pull request:\n%s", l)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestConsumeRecreatesAConsumerDeletedUnderIt: a consumer deleted while its handler runs (so that no
// request of ours waits to be told) is noticed at once by the pull request sent after the handler, which
// no server takes (503), and made anew. nats.go's iterator took the 503 for a notice and went on waiting
// for its request; the consumer was made anew once the watchdog had failed to read its info twice, 15 s
// apart, after the missed heartbeats: about 45 s. Now each request sent anew is answered 503 again, which
// asks the watchdog to look at once (the consumer's info: not found) and again StallAfter/3 later.
func TestConsumeRecreatesAConsumerDeletedUnderIt(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	before := lostPulls(t, "gone", "no_responders")
	delivered := make(chan uint64, 16)
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		first := true
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "gone", Concurrency: 1, MaxAckPending: 256},
			func(ctx context.Context, m *bus.Msg) error {
				delivered <- m.StreamSeq
				if first {
					first = false
					<-release
				}
				return nil
			})
	}()
	if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(`1`), nil); err != nil {
		t.Fatal(err)
	}
	<-delivered
	if err := b.Request(ctx, "$JS.API.CONSUMER.DELETE.T.gone", nil, nil); err != nil {
		t.Fatal(err)
	}
	close(release)
	released := time.Now()
	bustest.WaitWithin(t, "the pull request no server took counted", 2*time.Second, func() bool {
		return lostPulls(t, "gone", "no_responders") > before
	})
	select {
	case seq := <-delivered:
		// Made anew, the consumer starts over at the stream's first message.
		if seq != 1 {
			t.Fatalf("the consumer made anew delivered stream sequence %d first, want 1", seq)
		}
		if d := time.Since(released); d > 15*time.Second {
			t.Fatalf("the consumer was made anew %v after it was deleted, want within StallAfter", d.Round(time.Millisecond))
		}
	case <-time.After(time.Minute):
		t.Fatal("the deleted consumer was not made anew within a minute")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestConsumeKeepsWhatComesWhileEveryHandlerIsBusy: a message delivered while every handler is busy waits for
// one, however many heartbeats came first. nats.go's Messages iterator kept what arrived in a channel of
// Concurrency places and dropped what did not fit: with heartbeats every second (to notice a lost pull
// request in 2 s), those of the request it keeps waiting filled the channel while the handlers were busy,
// and a message delivered next was dropped and came back only after AckWait (30 s). With nats.go's 15 s
// heartbeats this test waits in vain for the heartbeats.
func TestConsumeKeepsWhatComesWhileEveryHandlerIsBusy(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}, WorkQueue: true}); err != nil {
		t.Fatal(err)
	}
	publish := func(v int) {
		t.Helper()
		raw, _ := json.Marshal(v)
		if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
	const conc = 4
	for v := range conc {
		publish(v)
	}
	// A plain subscriber on the inboxes sees the heartbeats the server sends the consumer's pull request.
	spy, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer spy.Close()
	var heartbeats atomic.Int64
	if _, err := spy.Subscribe("_INBOX.>", func(m *nats.Msg) {
		if m.Header.Get("Status") == "100" {
			heartbeats.Add(1)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	started := make(chan int, 2*conc)
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "busy", Concurrency: conc, MaxAckPending: 4 * conc},
			func(ctx context.Context, m *bus.Msg) error {
				var v int
				_ = json.Unmarshal(m.Data, &v)
				started <- v
				if v < conc {
					<-release
				}
				return nil
			})
	}()
	for range conc {
		<-started
	}
	from := heartbeats.Load()
	bustest.WaitWithin(t, "more heartbeats than the consumer has handlers, all of them busy", 30*time.Second, func() bool {
		return heartbeats.Load()-from > conc
	})
	publish(conc)
	close(release)
	freed := time.Now()
	select {
	case v := <-started:
		if v != conc {
			t.Fatalf("started %d, want %d", v, conc)
		}
		if d := time.Since(freed); d > 5*time.Second {
			t.Fatalf("the message published while every handler was busy started %v after they were free", d.Round(time.Millisecond))
		}
	case <-time.After(time.Minute):
		t.Fatal("the message published while every handler was busy did not start within a minute")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestConsumeBusyHandlerIsNoStall: a consumer with one handler that runs longer than StallAfter while messages
// wait is not taken for stalled: it asks for nothing while its handler runs (the removals handler waits up to
// its 30 s grace for the GC's event), and the watchdog made it anew for that at its first look ("consumer
// stalled: messages wait but none was delivered"), an API request and a warning each time.
func TestConsumeBusyHandlerIsNoStall(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		raw, _ := json.Marshal(i)
		if _, err := b.PublishCommand(ctx, "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
	// A plain subscriber on the consumer's info subject sees the watchdog's looks.
	spy, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer spy.Close()
	var looks atomic.Int64
	if _, err := spy.Subscribe("$JS.API.CONSUMER.INFO.T.busy-one", func(*nats.Msg) { looks.Add(1) }); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	before := lostPulls(t, "busy-one", "watchdog")
	var handled atomic.Int64
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "busy-one", Concurrency: 1, MaxAckPending: 256,
			StallAfter: 300 * time.Millisecond}, func(ctx context.Context, m *bus.Msg) error {
			if handled.Add(1) == 1 {
				<-release
			}
			return nil
		})
	}()
	bustest.WaitWithin(t, "the first message handled", 10*time.Second, func() bool { return handled.Load() == 1 })
	// Looks StallAfter, then 2x and 4x StallAfter (jittered) after the delivery, the handler busy throughout.
	bustest.WaitWithin(t, "three looks of the watchdog at the busy consumer", 20*time.Second, func() bool {
		return looks.Load() >= 3
	})
	if n := lostPulls(t, "busy-one", "watchdog") - before; n > 0 {
		t.Fatalf("the watchdog made the consumer anew %v times while its one handler was busy", n)
	}
	close(release)
	bustest.WaitWithin(t, "the messages waiting handled", 10*time.Second, func() bool { return handled.Load() == 3 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
