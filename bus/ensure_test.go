package bus_test

import (
	"context"
	"encoding/json"
	"errors"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// TestEnsureWithAReadOnlyIdentity: streams and buckets made by an operator are opened by an identity that may
// read stream info but not create or update streams (a node's agent), at once and without a refused
// JetStream API call; the operator's later change of a setting is applied to the existing stream.
func TestEnsureWithAReadOnlyIdentity(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	err := os.WriteFile(conf, []byte(`
jetstream { store_dir: "`+filepath.Join(dir, "js")+`" }
authorization {
  users: [
    { user: admin, password: admin }
    { user: node, password: node, permissions: {
        publish: ["$JS.API.INFO", "$JS.API.STREAM.INFO.*"]
        subscribe: ["_INBOX.>"]
    } }
  ]
}
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{Listen: "127.0.0.1:-1", ConfigFile: conf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	connect := func(user string) *bus.Bus {
		b, err := bus.Connect(ctx, srv.ClientURL(), bus.Options{User: user, Password: user, ConnectTimeout: 5 * time.Second})
		if err != nil {
			t.Fatalf("connect as %s: %v", user, err)
		}
		t.Cleanup(b.Close)
		return b
	}
	admin, node := connect("admin"), connect("node")

	kvc := bus.KVConfig{Bucket: "imagefleet-test", TTL: time.Hour}
	// Before the operator made them, the read-only identity gets an error naming what is missing.
	// Before the operator made them, the read-only identity is refused at once, and told so.
	begin := time.Now()
	if err := node.EnsureStreams(ctx, bus.StreamsConfig{}); !errors.Is(err, bus.ErrPermissionViolation) {
		t.Fatalf("EnsureStreams with a read-only identity and no streams: %v, want a permissions violation", err)
	}
	if d := time.Since(begin); d > 3*time.Second {
		t.Errorf("the refusal took %v: it should not wait out the JetStream API timeout", d)
	}
	if err := admin.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.KV(ctx, kvc); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	if err := node.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatalf("EnsureStreams with a read-only identity: %v", err)
	}
	if _, err := node.KV(ctx, kvc); err != nil {
		t.Fatalf("KV with a read-only identity: %v", err)
	}
	// A refused update would have waited out the JetStream API timeout (5 s) and been reported.
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("opening existing streams and a bucket took %v", d)
	}
	for _, subj := range []string{"$JS.API.STREAM.UPDATE." + events.EventsStream, "$JS.API.STREAM.UPDATE.KV_imagefleet-test",
		"$JS.API.STREAM.CREATE.KV_imagefleet-test"} {
		if err := node.PermissionViolation(subj); err != nil {
			t.Errorf("%s was attempted: %v", subj, err)
		}
	}

	// The operator changes a setting: the existing stream is updated in place.
	if err := admin.EnsureStreams(ctx, bus.StreamsConfig{EventsMaxAge: 48 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	info, err := admin.Stream(ctx, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	if info.MaxAge != 48*time.Hour {
		t.Errorf("events stream max age after the update = %v, want 48h", info.MaxAge)
	}
}

// TestEnsureWaitsForTheServer: a worker opening its bucket and streams while the server is away (a cluster
// electing its leaders, a restart) waits for it and goes on, instead of failing its start.
func TestEnsureWaitsForTheServer(t *testing.T) {
	r := startRestartable(t)
	b, err := bus.Connect(t.Context(), r.url(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	r.stop()
	bustest.WaitWithin(t, "the client to notice the server stopped", 10*time.Second, func() bool { return !b.Connected() })
	// No deadline, as an agent's: each JetStream call then times out after 5 s by itself.
	ctx := t.Context()
	done := make(chan error, 1)
	go func() {
		if err := b.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
			done <- err
			return
		}
		_, err := b.KV(ctx, bus.KVConfig{Bucket: "imagefleet-wait"})
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("returned while the server was down: %v", err)
	case <-time.After(6 * time.Second): // longer than the JetStream API timeout (5 s)
	}
	r.start()
	if err := <-done; err != nil {
		t.Fatalf("after the server came back: %v", err)
	}
	if _, err := b.Stream(ctx, events.EventsStream); err != nil {
		t.Fatal(err)
	}
}

// TestConsumeGoesOnAfterTheServerReturns: a consumer whose server went away and came back (its pull requests
// lost with it) pulls anew and handles what is published afterwards; a Consume that cannot have its
// consumer at all returns the error instead of spinning.
func TestConsumeGoesOnAfterTheServerReturns(t *testing.T) {
	r := startRestartable(t)
	b, err := bus.Connect(t.Context(), r.url(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "R", Subjects: []string{"r.>"}, WorkQueue: true}); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 10)
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "R", Durable: "r"}, func(_ context.Context, m *bus.Msg) error {
			got <- string(m.Data)
			return nil
		})
	}()
	publish := func(body string) {
		t.Helper()
		pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
		defer pcancel()
		if _, err := b.PublishCommand(pctx, "r."+body, body, json.RawMessage(`"`+body+`"`), nil); err != nil {
			t.Fatal(err)
		}
	}
	want := func(body string) {
		t.Helper()
		select {
		case m := <-got:
			if m != `"`+body+`"` {
				t.Fatalf("handled %s, want %q", m, body)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s not handled", body)
		}
	}
	publish("before")
	want("before")
	r.stop()
	time.Sleep(time.Second)
	r.start()
	publish("after")
	want("after")
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Consume after shutdown: %v", err)
	}

	// A consumer that cannot be created (a filter outside the stream) is an error, at once.
	cctx, ccancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer ccancel()
	err = b.Consume(cctx, bus.ConsumerConfig{Stream: "R", Durable: "bad", FilterSubjects: []string{"elsewhere.>"}},
		func(context.Context, *bus.Msg) error { return nil })
	if err == nil || cctx.Err() != nil {
		t.Fatalf("Consume with an impossible filter: %v (context %v)", err, cctx.Err())
	}
}

// TestKVPutWaitsOutAnOutage: a put while the server is away (longer than one JetStream API timeout) is
// retried until the server is back, within the bound, instead of failing the caller's work (a puller's
// pull intent, a heartbeat).
func TestKVPutWaitsOutAnOutage(t *testing.T) {
	r := startRestartable(t)
	b, err := bus.Connect(t.Context(), r.url(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: "imagefleet-outage"})
	if err != nil {
		t.Fatal(err)
	}
	r.stop()
	done := make(chan error, 1)
	go func() {
		_, err := kv.Put(t.Context(), "k", []byte("v"))
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("put returned while the server was down: %v", err)
	case <-time.After(6 * time.Second): // longer than the JetStream API timeout (5 s)
	}
	r.start()
	if err := <-done; err != nil {
		t.Fatalf("put after the server came back: %v", err)
	}
	v, _, err := kv.Get(t.Context(), "k")
	if err != nil || string(v) != "v" {
		t.Fatalf("get: %q, %v", v, err)
	}
}
