package bus_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// BenchmarkPublishEvent compares Bus.Publish (validation, JSON, CloudEvents headers, Nats-Msg-Id, sync ack)
// with a raw JetStream PublishMsg of the same bytes, and Bus.PublishAll with raw async publishing, in the
// same run on the same server.
func BenchmarkPublishEvent(b *testing.B) {
	srv, bb := bustest.Start(b)
	_, js := bustest.JetStream(b, srv)
	ctx := context.Background()
	ev, _ := events.New("bench-node", events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: "sha256:0123456789abcdef", Size: 1 << 20, Reason: "space"})
	m, _ := bus.EventMsg(ev)
	b.Logf("event body %d bytes", len(m.Data))

	measure := func(n int, f func(i int)) time.Duration {
		t0 := time.Now()
		for i := range n {
			f(i)
		}
		return time.Since(t0)
	}
	b.Run("mode=sync", func(b *testing.B) {
		const n = 2000
		raw := measure(n, func(int) {
			rm := nats.NewMsg(m.Subject)
			rm.Data = m.Data
			if _, err := js.PublishMsg(ctx, rm); err != nil {
				b.Fatal(err)
			}
		})
		b.ResetTimer()
		for b.Loop() {
			e := ev
			e.ID = events.NewID()
			if err := bb.Publish(ctx, e); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		ours := measure(n, func(int) {
			e := ev
			e.ID = events.NewID()
			if err := bb.Publish(ctx, e); err != nil {
				b.Fatal(err)
			}
		})
		b.ReportMetric(float64(n)/ours.Seconds(), "events/s")
		b.ReportMetric(float64(n)/raw.Seconds(), "raw-msgs/s")
		b.ReportMetric(float64(raw)/float64(ours), "ratio-to-raw")
	})
	b.Run("mode=async", func(b *testing.B) {
		const n = 20000
		batch := make([]events.Event, 1000)
		raw := measure(n/len(batch), func(int) {
			for range batch {
				rm := nats.NewMsg(m.Subject)
				rm.Data = m.Data
				if _, err := js.PublishMsgAsync(rm); err != nil {
					b.Fatal(err)
				}
			}
			<-js.PublishAsyncComplete()
		})
		// The same message with our headers (Nats-Msg-Id makes the server track duplicates): the part of the
		// gap that is the server's, not the client's.
		rawHeaders := measure(n/len(batch), func(int) {
			for range batch {
				e := ev
				e.ID = events.NewID()
				hm, _ := bus.EventMsg(e)
				if _, err := js.PublishMsgAsync(hm); err != nil {
					b.Fatal(err)
				}
			}
			<-js.PublishAsyncComplete()
		})
		ours := measure(n/len(batch), func(int) {
			for i := range batch {
				batch[i] = ev
				batch[i].ID = events.NewID()
			}
			if err := bb.PublishAll(ctx, batch); err != nil {
				b.Fatal(err)
			}
		})
		for b.Loop() {
		}
		b.ReportMetric(float64(n)/ours.Seconds(), "events/s")
		b.ReportMetric(float64(n)/raw.Seconds(), "raw-msgs/s")
		b.ReportMetric(float64(raw)/float64(ours), "ratio-to-raw")
		b.ReportMetric(float64(n)/rawHeaders.Seconds(), "raw-with-headers-msgs/s")
	})
}

// BenchmarkRequestReply compares Bus.Request + Bus.Serve (strict decode, reply envelope) with a raw core NATS
// request to a raw responder.
func BenchmarkRequestReply(b *testing.B) {
	srv, bb := bustest.Start(b)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	sub, _ := nc.Subscribe("raw.echo", func(m *nats.Msg) { _ = m.Respond(m.Data) })
	defer sub.Unsubscribe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = bb.Serve(ctx, "bus.echo", "q", func(_ context.Context, data []byte) (any, error) {
			var q events.QueryRequest
			return q, events.DecodeStrict(data, &q)
		})
	}()
	bustest.WaitFor(b, "the echo responder", func() bool { return bb.Request(ctx, "bus.echo", events.QueryRequest{}, nil) == nil })
	const n = 2000
	t0 := time.Now()
	for range n {
		if _, err := nc.Request("raw.echo", []byte(`{"limit":5}`), time.Second); err != nil {
			b.Fatal(err)
		}
	}
	raw := time.Since(t0) / n
	var out events.QueryRequest
	for b.Loop() {
		if err := bb.Request(ctx, "bus.echo", events.QueryRequest{Limit: 5}, &out); err != nil {
			b.Fatal(err)
		}
	}
	t1 := time.Now()
	for range n {
		if err := bb.Request(ctx, "bus.echo", events.QueryRequest{Limit: 5}, &out); err != nil {
			b.Fatal(err)
		}
	}
	ours := time.Since(t1) / n
	b.ReportMetric(float64(raw.Microseconds()), "raw-us/op")
	b.ReportMetric(float64(ours.Microseconds()), "us/request")
	b.ReportMetric(float64(raw)/float64(ours), "ratio-to-raw")
	cancel()
	<-done
}
