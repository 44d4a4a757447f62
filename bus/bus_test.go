package bus_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
)

func TestPublishIsDeduplicatedAndCarriesCloudEventsHeaders(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	ev, err := events.New("node-a.example", events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: "sha256:1", Size: 10, Reason: "space"})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := b.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	var got []bus.StreamMsg
	if err := b.Read(ctx, events.EventsStream, "", func(m bus.StreamMsg) error { got = append(got, m); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 {
		t.Fatalf("stored %d copies of one event, want 1", len(got))
	}
	m := got[0]
	if m.Subject != "imagefleet.evt.node-a_example.image.removed" {
		t.Errorf("subject = %q", m.Subject)
	}
	for h, want := range map[string]string{"ce-specversion": "1.0", "ce-type": "imagefleet.image.removed.v1", "ce-id": ev.ID, "Nats-Msg-Id": ev.ID} {
		if v := m.Header.Get(h); v != want {
			t.Errorf("header %s = %q, want %q", h, v, want)
		}
	}
	dec, err := events.DecodeEvent(m.Data)
	if err != nil || dec.Node != "node-a.example" {
		t.Fatalf("decode: %v %+v", err, dec)
	}
}

func TestServeAnswersErrorsAndSurvivesPanics(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error)
	go func() {
		done <- b.Serve(ctx, "t.echo", "q", func(_ context.Context, data []byte) (any, error) {
			var req events.QueryRequest
			if err := events.DecodeStrict(data, &req); err != nil {
				return nil, err
			}
			if req.Limit == 7 {
				panic("boom")
			}
			return req, nil
		})
	}()
	rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
	defer rcancel()
	bustest.WaitFor(t, "a responder on t.echo", func() bool { return b.Request(rctx, "t.echo", events.QueryRequest{Limit: 1}, nil) == nil })
	cases := []struct {
		name, body, wantErr string
	}{
		{"bad json", `{`, "malformed message"},
		{"unknown field", `{"limit":1,"bogus":2}`, `unknown field "bogus"`},
		{"wrong type", `{"limit":"x"}`, `field "limit" must be int`},
		{"negative", `{"limit":-1}`, "must not be negative"},
		{"panic", `{"limit":7}`, "internal error"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := b.RequestRaw(rctx, "t.echo", []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(rep.Error, tc.wantErr) {
				t.Fatalf("error %q does not contain %q", rep.Error, tc.wantErr)
			}
		})
	}
	var out events.QueryRequest
	if err := b.Request(rctx, "t.echo", events.QueryRequest{Limit: 3}, &out); err != nil || out.Limit != 3 {
		t.Fatalf("still serving after bad input: %v %+v", err, out)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestConsumeAcksRedeliversAndDeadLetters(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}, WorkQueue: true}); err != nil {
		t.Fatal(err)
	}
	var okCount, flaky atomic.Int32
	done := make(chan error)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "T", Durable: "c", MaxDeliver: 3, Backoff: []time.Duration{10 * time.Millisecond}},
			func(_ context.Context, m *bus.Msg) error {
				switch string(m.Data) {
				case `"poison"`:
					return bus.Permanent(errors.New("cannot parse"))
				case `"flaky"`:
					if flaky.Add(1) < 2 {
						return errors.New("try again")
					}
				case `"never"`:
					return errors.New("always fails")
				}
				okCount.Add(1)
				return nil
			})
	}()
	for _, body := range []string{"ok", "poison", "flaky", "never"} {
		raw, _ := json.Marshal(body)
		if _, err := b.PublishCommand(ctx, "t."+body, "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
	bustest.WaitFor(t, "two dead letters and two ok deliveries", func() bool {
		dl, err := b.DeadLetters(ctx, "")
		return err == nil && len(dl) == 2 && okCount.Load() == 2
	})
	dl, _ := b.DeadLetters(ctx, "")
	reasons := map[string]string{}
	for _, d := range dl {
		reasons[d.Subject] = d.Reason
	}
	if reasons["t.poison"] != "cannot parse" || reasons["t.never"] != "always fails" {
		t.Fatalf("dead letters: %+v", reasons)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestKVBatchAndList(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "t"})
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Batch(ctx, map[string][]byte{"n1.a": []byte("1"), "n1.b": []byte("2"), "n2.a": []byte("3")}, nil); err != nil {
		t.Fatal(err)
	}
	if err := kv.Batch(ctx, nil, []string{"n1.b"}); err != nil {
		t.Fatal(err)
	}
	got, err := kv.List(ctx, "n1.>")
	if err != nil || len(got) != 1 || got[0].Key != "n1.a" {
		t.Fatalf("list = %+v, %v", got, err)
	}
	if _, _, err := kv.Get(ctx, "n1.b"); !errors.Is(err, bus.ErrKeyNotFound) {
		t.Fatalf("deleted key: %v", err)
	}
}

func TestConnectSurvivesServerRestart(t *testing.T) {
	dir := t.TempDir()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: fmt.Sprintf("127.0.0.1:%d", testport.Free(t)), StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	url := srv.ClientURL()
	b, err := bus.Connect(t.Context(), url, bus.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	srv.Shutdown()
	listen := strings.TrimPrefix(url, "nats://")
	srv2, err := bus.StartServer(bus.ServerConfig{Listen: listen, StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Shutdown()
	ev, _ := events.New("n1", events.EntityImage, events.ActionDetected, events.ImageRecord{ID: "x"})
	bustest.WaitFor(t, "a publish after the server's restart", func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		return b.Publish(ctx, ev) == nil
	})
	// The reconnect handler that counts runs on nats.go's callback goroutine, possibly after the publish.
	bustest.WaitFor(t, "a reconnect counted", func() bool { return b.Reconnects() >= 1 })
}

func TestStartServerOnAPortInUseFailsAtOnce(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	began := time.Now()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: l.Addr().String(), StoreDir: t.TempDir()})
	if err == nil {
		srv.Shutdown()
		t.Fatal("a server started on a port in use")
	}
	if !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("error %q does not say the address is in use", err)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("took %s to fail, want well under the 30 s readiness wait", took)
	}
}

// TestReadReportsPending: each message Read delivers says how many matching messages followed it then (the
// pod index's backlog), counting only the filter's subjects.
func TestReadReportsPending(t *testing.T) {
	_, b := bustest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // a missing message fails, not hangs
	defer cancel()
	var msgs []bus.RawMsg
	for i := range 6 {
		node := "tail-a"
		if i%2 == 1 {
			node = "tail-b" // not in the filter
		}
		msgs = append(msgs, bus.RawMsg{Subject: events.EventSubject(node, events.EntityPod, events.ActionAdded),
			MsgID: fmt.Sprintf("tail-%d", i), Data: []byte("{}")})
	}
	if _, err := b.PublishMsgs(ctx, msgs); err != nil {
		t.Fatal(err)
	}
	var pending []uint64
	err := b.Read(ctx, events.EventsStream, events.PodEventSubjects("tail-a"), func(m bus.StreamMsg) error {
		pending = append(pending, m.Pending)
		if len(pending) == 3 {
			cancel()
		}
		return nil
	}, bus.Follow())
	if err != nil {
		t.Fatal(err)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("tail delivered %d of 3 messages in 30s", len(pending))
	}
	if want := []uint64{2, 1, 0}; fmt.Sprint(pending) != fmt.Sprint(want) {
		t.Fatalf("pending %v, want %v", pending, want)
	}
}
