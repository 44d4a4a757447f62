package integration_test

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// natsServer is an embedded nats-server that can be killed and started again on the same port and store,
// as a restarted server process would.
type natsServer struct {
	t     testing.TB
	addr  string
	store string
	conf  string
	mu    sync.Mutex
	srv   *bus.Server
}

func startNATS(t testing.TB, conf string) *natsServer {
	t.Helper()
	s := &natsServer{t: t, addr: fmt.Sprintf("127.0.0.1:%d", testport.Free(t)), store: t.TempDir(), conf: conf}
	s.start()
	u, err := url.Parse(s.srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	s.addr = u.Host
	t.Cleanup(s.stop)
	return s
}

func (s *natsServer) start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: s.addr, StoreDir: s.store, ConfigFile: s.conf})
	if err != nil {
		s.t.Fatalf("start nats-server: %v", err)
	}
	s.srv = srv
}

func (s *natsServer) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		s.srv.Shutdown()
		s.srv = nil
	}
}

func (s *natsServer) url() string { return "nats://" + s.addr }

// outage is how long NATS stays down in TestJournalOutage: IMAGEFLEET_OUTAGE (a Go duration), default 3s
// for a quick `go test`; `go tool task test` (and so CI) sets 30s, the outage.
func outage(t *testing.T) time.Duration {
	return testenv.Duration(t, "IMAGEFLEET_OUTAGE")
}

// storedEventIDs counts the stored copies of each event id matching filter.
func storedEventIDs(t *testing.T, ctx context.Context, b *bus.Bus, filter string) map[string]int {
	t.Helper()
	got := map[string]int{}
	err := b.Read(ctx, events.EventsStream, filter, func(m bus.StreamMsg) error {
		if ev, err := events.DecodeEvent(m.Data); err == nil {
			got[ev.ID]++
		} else {
			t.Errorf("stored event %d: %v", m.Seq, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestJournalOutage: an agent's bus with a journal produces events steadily while NATS is killed, stays down
// for IMAGEFLEET_OUTAGE, and comes back. Every event produced arrives in the events stream, none twice.
func TestJournalOutage(t *testing.T) {
	down := outage(t)
	ctx := t.Context()
	srv := startNATS(t, "")
	const node = "edge-journal"
	b, err := bus.Connect(ctx, srv.url(), bus.Options{Name: "agent-" + node, JournalDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}

	var (
		mu         sync.Mutex
		ids        []string
		duringDown atomic.Int64
		isDown     atomic.Bool
		publishErr atomic.Int64
	)
	pctx, stopProducing := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-pctx.Done():
				return
			case <-tick.C:
			}
			ev, err := events.New(node, events.EntityImage, events.ActionDetected, events.ImageRemoved{ID: "sha256:x", Size: int64(i)})
			if err != nil {
				publishErr.Add(1)
				continue
			}
			if err := b.Publish(pctx, ev); err != nil {
				publishErr.Add(1)
				continue
			}
			mu.Lock()
			ids = append(ids, ev.ID)
			mu.Unlock()
			if isDown.Load() {
				duringDown.Add(1)
			}
		}
	}()

	time.Sleep(500 * time.Millisecond) // produce for a while with NATS up
	isDown.Store(true)
	srv.stop()
	t.Logf("nats-server killed; down for %s", down)
	time.Sleep(down)
	// And at least until an event was produced meanwhile, however the producer was scheduled.
	bustest.WaitWithin(t, "an event produced while NATS is down", time.Minute, func() bool { return duringDown.Load() > 0 })
	srv.start()
	isDown.Store(false)
	back := time.Now()
	time.Sleep(500 * time.Millisecond) // and a while after it is back
	stopProducing()
	wg.Wait()

	if n := publishErr.Load(); n != 0 {
		t.Errorf("%d publishes failed; with a journal none should", n)
	}
	mu.Lock()
	produced := append([]string(nil), ids...)
	mu.Unlock()
	var got map[string]int
	bustest.Eventually(t, "every produced event stored", 30*time.Second+down, func() error {
		got = storedEventIDs(t, ctx, b, events.NodeEvents(node))
		lost := 0
		for _, id := range produced {
			if got[id] == 0 {
				lost++
			}
		}
		if lost != 0 {
			return fmt.Errorf("lost %d of %d events; journal %+v", lost, len(produced), b.JournalStats())
		}
		return nil
	})
	dups := 0
	for _, n := range got {
		if n > 1 {
			dups += n - 1
		}
	}
	t.Logf("outage %s: produced %d events (%d while NATS was down), duplicates %d, all stored %s after NATS was back; journal %+v",
		down, len(produced), duringDown.Load(), dups, time.Since(back).Round(time.Millisecond), b.JournalStats())
	if dups != 0 {
		t.Errorf("%d duplicates stored", dups)
	}
	if len(got) != len(produced) {
		t.Errorf("stored %d distinct events, produced %d", len(got), len(produced))
	}
	if duringDown.Load() == 0 {
		t.Error("no event was produced while NATS was down: the test proves nothing")
	}
}
