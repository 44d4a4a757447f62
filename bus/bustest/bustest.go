// Package bustest starts a real embedded nats-server with JetStream for a test, in milliseconds.
package bustest

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/imagefleet/imagefleet/bus"
)

// Server starts an embedded nats-server on a free loopback port with its store in a temp dir; it is shut down
// when the test ends.
func Server(t testing.TB) *bus.Server {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: "127.0.0.1:-1", StoreDir: t.TempDir()})
	if err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// Connect connects to srv with the streams ensured; closed when the test ends.
func Connect(t testing.TB, srv *bus.Server) *bus.Bus {
	t.Helper()
	b, err := bus.Connect(context.Background(), srv.ClientURL(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(context.Background(), bus.StreamsConfig{}); err != nil {
		t.Fatalf("ensure streams: %v", err)
	}
	return b
}

// Start is Server then Connect.
func Start(t testing.TB) (*bus.Server, *bus.Bus) {
	t.Helper()
	srv := Server(t)
	return srv, Connect(t, srv)
}

// IgnoreSourcing ignores the embedded nats-server's goroutines of a stream that sources another (the pods
// stream): the one setting up the source's consumer waits out its request's timeout even when the server
// shuts down, and the one copying the messages lives in the server, not in the code under test.
func IgnoreSourcing() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*stream).trySetupSourceConsumer.func3"),
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*stream).processAllSourceMsgs"),
	}
}

// IgnoreServer is opts plus the embedded nats-server's own goroutines: its streams', consumers' and file
// store's loops (some start a moment after the request that made their stream or consumer was answered, so
// a snapshot taken before the code under test runs can miss them) and a sourcing stream's (IgnoreSourcing).
// For a goleak check of a worker while its server still runs; VerifyNoLeaks checks after the server is gone.
func IgnoreServer(opts ...goleak.Option) []goleak.Option {
	for _, f := range []string{
		"(*consumer).loopAndGatherMsgs", "(*consumer).processInboundAcks", "(*consumer).processInboundNextMsgReqs",
		"(*stream).signalConsumersLoop", "(*fileStore).flushStreamStateLoop", "(*stream).internalLoop",
		"(*consumer).deleteNotActive", "(*fileStore).syncBlocks", "(*msgBlock).spinUpFlushLoop",
	} {
		opts = append(opts, goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server."+f))
	}
	return append(opts, IgnoreSourcing()...)
}

// VerifyNoLeaks checks, after every cleanup of the test (servers shut down, connections closed), that no
// goroutine started during the test is left. Call it first in the test, before Start.
func VerifyNoLeaks(t testing.TB) {
	t.Helper()
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		if err := goleak.Find(append(IgnoreSourcing(), ignore)...); err != nil {
			t.Error(err)
		}
	})
}

// JetStream connects to srv with nats.go alone (closed at the test's end), for what a test does beside the
// bus: a push consumer, a bucket with settings the bus does not make.
func JetStream(t testing.TB, srv *bus.Server) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}
