package bus_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestPullHeartbeatIsTheConnections: the pull requests of a connection ask for the idle heartbeat its
// Options.PullHeartbeat names (1 s when unset), and Connect refuses one outside 1 s to 10 s.
func TestPullHeartbeatIsTheConnections(t *testing.T) {
	srv := bustest.Server(t)
	for _, bad := range []time.Duration{500 * time.Millisecond, 11 * time.Second} {
		if b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{PullHeartbeat: bad}); err == nil {
			b.Close()
			t.Errorf("PullHeartbeat %s: connected", bad)
		}
	}
	spy, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer spy.Close()
	requests := make(chan *nats.Msg, 16)
	sub, err := spy.ChanSubscribe("$JS.API.CONSUMER.MSG.NEXT.>", requests)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		set, want time.Duration
	}{{0, time.Second}, {4 * time.Second, 4 * time.Second}} {
		b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{PullHeartbeat: c.set})
		if err != nil {
			t.Fatal(err)
		}
		stream := "HB" + strconv.Itoa(int(c.want.Seconds()))
		if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: stream, Subjects: []string{"hb." + stream + ".>"}}); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- b.Consume(ctx, bus.ConsumerConfig{Stream: stream, Durable: "d"}, func(context.Context, *bus.Msg) error { return nil })
		}()
		// The first request of this stream's consumer (one of an earlier case may still come in).
		subject := "$JS.API.CONSUMER.MSG.NEXT." + stream + ".d"
		var m *nats.Msg
		for m == nil {
			select {
			case got := <-requests:
				if got.Subject == subject {
					m = got
				}
			case <-time.After(bustest.Timeout):
				t.Fatalf("PullHeartbeat %s: no pull request", c.set)
			}
		}
		var req struct {
			Heartbeat time.Duration `json:"idle_heartbeat"`
		}
		if err := json.Unmarshal(m.Data, &req); err != nil || req.Heartbeat != c.want {
			t.Errorf("PullHeartbeat %s: a pull request asked for %s (%v), want %s", c.set, req.Heartbeat, err, c.want)
		}
		cancel()
		<-done
		b.Close()
	}
}
