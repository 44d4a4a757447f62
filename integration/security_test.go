package integration_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/puller"
)

// secured is a nats-server started from a generated config (accounts, one nkey per node, TLS with client
// certificates), with the identities' seed files.
type secured struct {
	srv   *natsServer
	certs natsconf.Certs
	seeds map[string]string
}

func startSecured(t *testing.T, nodes ...string) *secured {
	t.Helper()
	dir := t.TempDir()
	certs, err := natsconf.GenerateCerts(dir+"/tls", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	res, err := natsconf.Generate(dir, natsconf.Options{Nodes: nodes, Listen: "127.0.0.1:4222",
		TLS: &natsconf.TLSFiles{CA: certs.CA, Cert: certs.ServerCert, Key: certs.ServerKey}})
	if err != nil {
		t.Fatal(err)
	}
	s := &secured{srv: startNATS(t, res.ConfigFile), certs: certs, seeds: map[string]string{}}
	for _, id := range res.Identities {
		s.seeds[id.Name] = id.SeedFile
	}
	// The admin creates the streams and buckets: node users may not.
	admin := s.connect(t, natsconf.RoleAdmin)
	if err := admin.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.KV(t.Context(), bus.KVConfig{Bucket: "imagefleet-records"}); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s *secured) options(name string) bus.Options {
	return bus.Options{Name: "test-" + name, NKeyFile: s.seeds[name], TLSCA: s.certs.CA, TLSCert: s.certs.ClientCert,
		TLSKey: s.certs.ClientKey, ConnectTimeout: 5 * time.Second}
}

func (s *secured) connect(t *testing.T, name string) *bus.Bus {
	t.Helper()
	b, err := bus.Connect(t.Context(), "tls://"+s.srv.addr, s.options(name))
	if err != nil {
		t.Fatalf("connect as %s: %v", name, err)
	}
	t.Cleanup(b.Close)
	return b
}

// jetStream connects as name with nats.go alone, for what a client may do with its rights beyond what the bus
// does.
func (s *secured) jetStream(t *testing.T, name string) jetstream.JetStream {
	t.Helper()
	nkey, err := nats.NkeyOptionFromSeed(s.seeds[name])
	if err != nil {
		t.Fatal(err)
	}
	pub, err := bus.NKeyPublic(s.seeds[name])
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect("tls://"+s.srv.addr, nkey, nats.RootCAs(s.certs.CA), nats.ClientCert(s.certs.ClientCert, s.certs.ClientKey),
		nats.CustomInboxPrefix(bus.InboxRoot+"."+pub))
	if err != nil {
		t.Fatalf("connect as %s: %v", name, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// counterValue is the value of the counter name (no labels) on reg.
func counterValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("%s not on the registry", name)
	return 0
}

// wantViolation checks that err wraps bus.ErrPermissionViolation and says so in words.
func wantViolation(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want a permissions violation", what)
		return
	}
	if !errors.Is(err, bus.ErrPermissionViolation) || !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
		t.Errorf("%s: error %q, want a permissions violation", what, err)
	}
}

// waitViolation waits until the server reported a violation for subject on b.
func waitViolation(t *testing.T, b *bus.Bus, subject string) {
	t.Helper()
	bustest.Eventually(t, "a permissions violation reported for "+subject, bustest.Timeout, func() error {
		if b.PermissionViolation(subject) == nil {
			return errors.New("none yet")
		}
		return nil
	})
	wantViolation(t, subject, b.PermissionViolation(subject))
}

func short(t *testing.T) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), 1500*time.Millisecond)
}

func TestSecurityConnectionNeedsKeyAndClientCertificate(t *testing.T) {
	s := startSecured(t, "node-a")
	url := "tls://" + s.srv.addr
	for _, tc := range []struct {
		name string
		opts bus.Options
	}{
		{name: "no nkey", opts: bus.Options{TLSCA: s.certs.CA, TLSCert: s.certs.ClientCert, TLSKey: s.certs.ClientKey}},
		{name: "no client certificate", opts: bus.Options{NKeyFile: s.seeds["node-a"], TLSCA: s.certs.CA}},
		{name: "plain text", opts: bus.Options{NKeyFile: s.seeds["node-a"]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.ConnectTimeout = 500 * time.Millisecond
			u := url
			if tc.name == "plain text" {
				u = "nats://" + s.srv.addr
			}
			b, err := bus.Connect(t.Context(), u, tc.opts)
			if err == nil {
				b.Close()
				t.Fatal("connected; want refused")
			}
		})
	}
}

// TestSecurityNodeIsolation: node A's credentials publish A's events, serve A's commands, consume A's pull
// queue and write A's records; they cannot command node B, read B's commands, consume B's queue, write B's
// records, publish B's events, or read other users' replies. Each refusal surfaces as a permissions
// violation.
func TestSecurityNodeIsolation(t *testing.T) {
	const nodeA, nodeB = "node-a", "node-b.example"
	s := startSecured(t, nodeA, nodeB)
	a := s.connect(t, nodeA)
	bb := s.connect(t, nodeB)
	admin := s.connect(t, natsconf.RoleAdmin)
	ctx := t.Context()

	// B serves its commands; nothing A does may reach it.
	var bGot atomic.Int64
	serveCtx, stopServe := context.WithCancel(ctx)
	defer stopServe()
	go func() {
		_ = bb.Serve(serveCtx, events.CommandSubject(nodeB, events.VerbGC), "gc", func(context.Context, []byte) (any, error) {
			bGot.Add(1)
			return "ran", nil
		})
	}()
	go func() {
		_ = a.Serve(serveCtx, events.CommandSubject(nodeA, events.VerbDetect), "detect", func(context.Context, []byte) (any, error) {
			return "detected", nil
		})
	}()
	waitServing(t, admin, events.CommandSubject(nodeB, events.VerbGC))
	waitServing(t, admin, events.CommandSubject(nodeA, events.VerbDetect))

	t.Run("own events", func(t *testing.T) {
		ev, _ := events.New(nodeA, events.EntityImage, events.ActionDetected, nil)
		if err := a.Publish(ctx, ev); err != nil {
			t.Fatalf("publish own event: %v", err)
		}
	})
	t.Run("another node's events", func(t *testing.T) {
		ev, _ := events.New(nodeB, events.EntityImage, events.ActionRemoved, nil)
		c, cancel := short(t)
		defer cancel()
		wantViolation(t, "publish B's event", a.Publish(c, ev))
		if got := storedEventIDs(t, ctx, admin, events.NodeEvents(nodeB)); got[ev.ID] != 0 {
			t.Error("B's event forged by A was stored")
		}
	})
	t.Run("own commands answered", func(t *testing.T) {
		var out string
		c, cancel := short(t)
		defer cancel()
		if err := admin.Request(c, events.CommandSubject(nodeA, events.VerbDetect), nil, &out); err != nil || out != "detected" {
			t.Fatalf("admin -> A detect: %q, %v", out, err)
		}
	})
	t.Run("command another node", func(t *testing.T) {
		base := bGot.Load()
		c, cancel := short(t)
		defer cancel()
		wantViolation(t, "A requests B's gc", a.Request(c, events.CommandSubject(nodeB, events.VerbGC), nil, nil))
		c2, cancel2 := short(t)
		defer cancel2()
		_, err := a.PublishCommand(c2, events.PullSubject(nodeB), "", map[string]string{"image": "x"}, nil)
		wantViolation(t, "A queues a pull on B", err)
		c3, cancel3 := short(t)
		defer cancel3()
		_, err = a.PublishCommand(c3, events.LegacyPullSubject(nodeB), "", map[string]string{"image": "x"}, nil)
		wantViolation(t, "A queues a pull on B's legacy queue", err)
		if n := bGot.Load() - base; n != 0 {
			t.Errorf("B ran %d commands sent by A", n)
		}
	})
	t.Run("read another node's commands", func(t *testing.T) {
		subCtx, cancel := context.WithCancel(ctx)
		var got atomic.Int64
		done := make(chan struct{})
		subject := "imagefleet.cmd." + events.NodeToken(nodeB) + ".>"
		go func() {
			defer close(done)
			_ = a.Subscribe(subCtx, subject, func(string, map[string][]string, []byte) { got.Add(1) })
		}()
		waitViolation(t, a, subject)
		c, cancelReq := short(t)
		var out string
		if err := admin.Request(c, events.CommandSubject(nodeB, events.VerbGC), nil, &out); err != nil {
			t.Errorf("admin -> B gc: %v", err)
		}
		cancelReq()
		cancel()
		<-done
		if got.Load() != 0 {
			t.Errorf("A read %d of B's commands", got.Load())
		}
	})
	t.Run("read other users' replies", func(t *testing.T) {
		subCtx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = a.Subscribe(subCtx, "_INBOX.>", func(string, map[string][]string, []byte) {})
		}()
		waitViolation(t, a, "_INBOX.>")
		cancel()
		<-done
	})
	t.Run("own pull queue only", func(t *testing.T) {
		if events.PullStreamOf(nodeA) == events.PullStreamOf(nodeB) {
			t.Fatalf("nodes %s and %s share pull partition %s: the cross-partition cases need two", nodeA, nodeB, events.PullStreamOf(nodeA))
		}
		// consumeOne consumes durable on stream with filter as A and returns the first body delivered.
		consumeOne := func(t *testing.T, stream, filter string) {
			t.Helper()
			cctx, cancel := context.WithCancel(ctx)
			got := make(chan string, 1)
			done := make(chan error, 1)
			go func() {
				done <- a.Consume(cctx, bus.ConsumerConfig{Stream: stream, Durable: events.PullerDurable(nodeA),
					FilterSubjects: []string{filter}, MaxAckPending: 2},
					func(_ context.Context, m *bus.Msg) error {
						select {
						case got <- string(m.Data):
						default:
						}
						return nil
					})
			}()
			select {
			case body := <-got:
				if !strings.Contains(body, "busybox") {
					t.Errorf("A's pull command = %s", body)
				}
			case err := <-done:
				t.Fatalf("consume own pull queue on %s: %v", stream, err)
			case <-time.After(10 * time.Second):
				t.Fatalf("A's pull command not delivered to A's consumer on %s", stream)
			}
			cancel()
			<-done
		}
		if _, err := admin.PublishCommand(ctx, events.PullSubject(nodeA), "p1", map[string]string{"image": "busybox"}, nil); err != nil {
			t.Fatal(err)
		}
		consumeOne(t, events.PullStreamOf(nodeA), events.PullSubject(nodeA))
		// Its legacy durable on the single queue of earlier releases, drained during an upgrade.
		if _, err := admin.PublishCommand(ctx, events.LegacyPullSubject(nodeA), "p2", map[string]string{"image": "busybox"}, nil); err != nil {
			t.Fatal(err)
		}
		consumeOne(t, events.PullStream, events.LegacyPullSubject(nodeA))

		refused := func(t *testing.T, what, stream, durable, filter string) {
			t.Helper()
			c, cancel := short(t)
			defer cancel()
			cc := bus.ConsumerConfig{Stream: stream, Durable: durable}
			if filter != "" {
				cc.FilterSubjects = []string{filter}
			}
			if err := a.Consume(c, cc, func(context.Context, *bus.Msg) error { return nil }); err == nil {
				t.Fatalf("A created %s", what)
			}
			if filter != "" {
				waitViolation(t, a, "$JS.API.CONSUMER.CREATE."+stream+"."+durable+"."+filter)
			}
		}
		durA, durB := events.PullerDurable(nodeA), events.PullerDurable(nodeB)
		refused(t, "B's consumer on B's partition", events.PullStreamOf(nodeB), durB, events.PullSubject(nodeB))
		refused(t, "B's legacy consumer", events.PullStream, durB, events.LegacyPullSubject(nodeB))
		// Its own name on B's partition stream, filtered to B's requests.
		refused(t, "a consumer on B's partition", events.PullStreamOf(nodeB), durA, events.PullSubject(nodeB))
		// Its own name on its partition, filtered to the whole partition (every node of it).
		refused(t, "a consumer over its whole partition", events.PullStreamOf(nodeA), durA,
			events.PullPartitionSubjects(events.PullPartition(nodeA)))
		// Nor a consumer of its own name over a whole queue (no filter).
		refused(t, "an unfiltered consumer on its partition", events.PullStreamOf(nodeA), durA+"-all", "")
		refused(t, "an unfiltered consumer on the legacy queue", events.PullStream, durA+"-all", "")
	})
	t.Run("own records only", func(t *testing.T) {
		kv, err := a.KVExisting(ctx, "imagefleet-records")
		if err != nil {
			t.Fatal(err)
		}
		own := events.NodeToken(nodeA) + ".sha256_1"
		if _, err := kv.Put(ctx, own, []byte("{}")); err != nil {
			t.Fatalf("put own record: %v", err)
		}
		if v, _, err := kv.Get(ctx, own); err != nil || string(v) != "{}" {
			t.Fatalf("get own record: %q %v", v, err)
		}
		c, cancel := short(t)
		defer cancel()
		other := events.NodeToken(nodeB) + ".sha256_1"
		_, err = kv.Put(c, other, []byte("{}"))
		if err == nil {
			t.Fatal("A wrote B's record")
		}
		waitViolation(t, a, "$KV.imagefleet-records."+other)
	})
	t.Run("own GC pass lease only", func(t *testing.T) {
		if err := gc.EnsureLeaseBucket(ctx, admin); err != nil {
			t.Fatal(err)
		}
		kvA, err := a.KVExisting(ctx, events.GCLeaseBucket)
		if err != nil {
			t.Fatal(err)
		}
		kvB, err := bb.KVExisting(ctx, events.GCLeaseBucket)
		if err != nil {
			t.Fatal(err)
		}
		own, other := events.NodeToken(nodeA), events.NodeToken(nodeB)
		// Each node takes, reads, renews (compare and set) its own lease.
		rev, err := kvA.Create(ctx, own, []byte(`{"holder":"a"}`))
		if err != nil {
			t.Fatalf("A takes its own lease: %v", err)
		}
		if v, _, err := kvA.Get(ctx, own); err != nil || string(v) != `{"holder":"a"}` {
			t.Fatalf("A reads its own lease: %q %v", v, err)
		}
		if _, err := kvA.Update(ctx, own, []byte(`{"holder":"a","renewed":true}`), rev); err != nil {
			t.Fatalf("A renews its own lease: %v", err)
		}
		bRev, err := kvB.Create(ctx, other, []byte(`{"holder":"b"}`))
		if err != nil {
			t.Fatalf("B takes its own lease: %v", err)
		}
		// A can neither take B's lease over B's revision, nor create it, nor release it.
		c, cancel := short(t)
		defer cancel()
		if _, err := kvA.Update(c, other, []byte(`{"holder":"a"}`), bRev); err == nil {
			t.Fatal("A took B's GC pass lease")
		}
		waitViolation(t, a, "$KV."+events.GCLeaseBucket+"."+other)
		c2, cancel2 := short(t)
		defer cancel2()
		if err := kvA.Delete(c2, other); err == nil {
			t.Error("A released B's GC pass lease")
		}
		if v, r, err := kvB.Get(ctx, other); err != nil || r != bRev || string(v) != `{"holder":"b"}` {
			t.Errorf("B's lease after A's attempts: %q rev %d (want %d) %v", v, r, bRev, err)
		}
	})
	t.Run("no stream changes", func(t *testing.T) {
		c, cancel := short(t)
		defer cancel()
		if err := a.EnsureStream(c, bus.StreamConfig{Name: "EVIL", Subjects: []string{"evil.>"}}); err == nil {
			t.Error("a node created a stream")
		}
	})
	t.Run("a push consumer aimed at another node's commands", func(t *testing.T) {
		// A may create consumers on its own events, and the server checks a consumer's deliver subject
		// against its syntax only: A can have its stored events delivered to B's command subject, in B's
		// queue group. The server does deliver them (B's bus counts what it dropped); B's worker never reads one.
		reg := prometheus.NewRegistry()
		if err := bus.RegisterMetrics(reg); err != nil {
			t.Fatal(err)
		}
		refusedBefore := counterValue(t, reg, "imagefleet_bus_consumer_deliveries_refused_total")
		js := s.jetStream(t, nodeA)
		base := bGot.Load()
		_, err := js.CreateOrUpdatePushConsumer(ctx, events.EventsStream, jetstream.ConsumerConfig{Name: "aimed-at-b",
			FilterSubject: events.NodeEvents(nodeA), DeliverSubject: events.CommandSubject(nodeB, events.VerbGC), DeliverGroup: "gc",
			AckPolicy: jetstream.AckNonePolicy})
		if err != nil {
			t.Fatalf("A creates a push consumer on its own events (the rights a node holds allow it): %v", err)
		}
		adminJS := s.jetStream(t, natsconf.RoleAdmin)
		t.Cleanup(func() { _ = adminJS.DeleteConsumer(context.Background(), events.EventsStream, "aimed-at-b") })
		ev, _ := events.New(nodeA, events.EntityImage, events.ActionDetected, nil)
		if err := a.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
		bustest.WaitFor(t, "B's bus to refuse what A's consumer delivered", func() bool {
			return counterValue(t, reg, "imagefleet_bus_consumer_deliveries_refused_total") > refusedBefore
		})
		var out string
		c, cancel := short(t)
		defer cancel()
		if err := admin.Request(c, events.CommandSubject(nodeB, events.VerbGC), nil, &out); err != nil || out != "ran" {
			t.Fatalf("admin -> B gc: %q, %v", out, err)
		}
		if n := bGot.Load() - base; n != 1 {
			t.Errorf("B ran %d commands, want the admin's only", n)
		}
	})
}

// TestSecurityFleetAndInventory: the fleet user commands any node and cannot forge node events; the
// inventory user cannot command nodes.
func TestSecurityFleetAndInventory(t *testing.T) {
	const node = "node-a"
	s := startSecured(t, node)
	a := s.connect(t, node)
	fleet := s.connect(t, natsconf.RoleFleet)
	inv := s.connect(t, natsconf.RoleInventory)
	ctx := t.Context()
	serveCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		_ = a.Serve(serveCtx, events.CommandSubject(node, events.VerbGC), "gc", func(context.Context, []byte) (any, error) { return "ok", nil })
	}()
	waitServing(t, fleet, events.CommandSubject(node, events.VerbGC))
	if _, err := fleet.PublishCommand(ctx, events.PullSubject(node), "f1", map[string]string{"image": "x"}, nil); err != nil {
		t.Errorf("fleet queues a pull: %v", err)
	}
	ev, _ := events.New(node, events.EntityImage, events.ActionRemoved, nil)
	c, cancel := short(t)
	defer cancel()
	wantViolation(t, "fleet forges a node event", fleet.Publish(c, ev))
	c2, cancel2 := short(t)
	defer cancel2()
	wantViolation(t, "inventory commands a node", inv.Request(c2, events.CommandSubject(node, events.VerbGC), nil, nil))
}

// waitServing polls until a request to subject is answered.
func waitServing(t *testing.T, b *bus.Bus, subject string) {
	t.Helper()
	bustest.Eventually(t, subject+" served", bustest.Timeout, func() error {
		c, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		if err := b.Request(c, subject, nil, nil); err != nil && !errors.Is(err, bus.ErrRemote) {
			return err
		}
		return nil
	})
}

// TestSecurityNoSecretLeaks runs the puller (real NATS with a journal, the hollow CRI runtime requiring
// registry auth) with pull secrets of known values, pulls with the right secret, a wrong one, a missing one
// and none, and scans everything that leaves the worker for the secret values (plain and base64): every log
// line of the worker and the bus at debug level, every stored event, every dead letter, the journal file.
func TestSecurityNoSecretLeaks(t *testing.T) {
	const node, registry = "leak-node", "127.0.0.1:5000"
	const goodPass, badPass = "G00d-Pull-Secret-Value", "Wr0ng-Pull-Secret-Value"
	ctx := t.Context()
	var logs bustest.SyncBuffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	srv := startNATS(t, "")
	journalDir := t.TempDir()
	b, err := bus.Connect(ctx, srv.url(), bus.Options{Name: "leak", Logger: log, JournalDir: journalDir})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	rt := hollow.New(hollow.Options{Name: node})
	rt.RequireAuth(registry, "alice", goodPass)
	cl, stopCRI, err := rt.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stopCRI()
	secrets := t.TempDir()
	for name, pass := range map[string]string{"good": goodPass, "bad": badPass} {
		auth := base64.StdEncoding.EncodeToString([]byte("alice:" + pass))
		cfg := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, registry, auth)
		secret := fmt.Sprintf("apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: team-a\ntype: kubernetes.io/dockerconfigjson\ndata:\n  .dockerconfigjson: %s\n",
			name, base64.StdEncoding.EncodeToString([]byte(cfg)))
		if err := os.WriteFile(filepath.Join(secrets, name+".yaml"), []byte(secret), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	p, err := puller.New(puller.Config{Node: node, PullSecretsDir: secrets, Logger: log, MaxDeliver: 2,
		BackoffInitial: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()}, cl, b)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	var stopOnce sync.Once
	stopPuller := func() {
		stopOnce.Do(func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("puller Run: %v", err)
			}
		})
	}
	defer stopPuller()

	pod := &events.PodRef{Namespace: "team-a", Name: "app", UID: "uid-1"}
	reqs := []events.PullRequest{
		{ID: "good", Image: registry + "/private/app:v1", Pod: pod, Secrets: []string{"good"}},
		{ID: "bad", Image: registry + "/private/app:v2", Pod: pod, Secrets: []string{"bad"}},
		{ID: "missing", Image: registry + "/private/app:v3", Pod: pod, Secrets: []string{"nope"}},
		{ID: "none", Image: registry + "/private/app:v4", Pod: pod},
		{ID: "both", Image: registry + "/private/app:v5", Pod: pod, Secrets: []string{"bad", "good"}},
	}
	for _, r := range reqs {
		if _, err := puller.Enqueue(ctx, b, node, r); err != nil {
			t.Fatal(err)
		}
	}
	// Wait for a terminal event of every request.
	var stored []string
	bustest.Eventually(t, "a terminal event of every request", 20*time.Second, func() error {
		stored = stored[:0]
		terminal := map[string]bool{}
		err := b.Read(ctx, events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
			stored = append(stored, string(m.Data))
			if ev, err := events.DecodeEvent(m.Data); err == nil && ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
				var r events.PullResult
				if ev.DecodeData(&r) == nil {
					terminal[r.RequestID] = true
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(terminal) < len(reqs) {
			return fmt.Errorf("results for %d of %d requests", len(terminal), len(reqs))
		}
		return nil
	})
	dls, err := b.DeadLetters(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	stopPuller()
	journal, err := os.ReadFile(filepath.Join(journalDir, bus.JournalFile))
	if err != nil {
		t.Fatal(err)
	}
	var dlText []string
	for _, d := range dls {
		dlText = append(dlText, d.Reason, string(d.Data))
	}
	// The puller's KV state: pulled records (KEP-2535, which keep a hash of the credentials) and backoff.
	var kvText []string
	for _, bucket := range []string{events.PullRecordsBucket, events.PullBackoffBucket} {
		kv, err := b.KV(ctx, bus.KVConfig{Bucket: bucket})
		if err != nil {
			t.Fatal(err)
		}
		entries, err := kv.List(ctx, ">")
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			kvText = append(kvText, e.Key, string(e.Value))
		}
	}
	haystacks := map[string]string{
		"logs":         logs.String(),
		"events":       strings.Join(stored, "\n"),
		"dead letters": strings.Join(dlText, "\n"),
		"journal":      string(journal),
		"kv state":     strings.Join(kvText, "\n"),
	}
	needles := []string{goodPass, badPass,
		base64.StdEncoding.EncodeToString([]byte("alice:" + goodPass)), base64.StdEncoding.EncodeToString([]byte("alice:" + badPass))}
	for where, text := range haystacks {
		for _, n := range needles {
			if strings.Contains(text, n) {
				t.Errorf("secret %q appears in the %s", n[:6]+"...", where)
			}
		}
	}
	t.Logf("scanned %d bytes of logs, %d events, %d dead letters, %d bytes of journal, %d KV entries: no secret",
		len(haystacks["logs"]), len(stored), len(dls), len(journal), len(kvText)/2)
	if len(stored) < len(reqs) || logs.Len() == 0 || len(kvText) == 0 {
		t.Error("nothing was produced: the scan proves nothing")
	}
}

// TestSecurityAgentRunsWithANodeIdentity: after `imagefleet bus init` with the admin identity, an agent with
// every default worker and only its node's nkey starts, detects, answers its queries and heartbeats; a
// node identity alone cannot initialise the streams, and says why.
func TestSecurityAgentRunsWithANodeIdentity(t *testing.T) {
	const node = "node-a"
	dir := t.TempDir()
	certs, err := natsconf.GenerateCerts(dir+"/tls", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	res, err := natsconf.Generate(dir, natsconf.Options{Nodes: []string{node}, Listen: "127.0.0.1:4222",
		TLS: &natsconf.TLSFiles{CA: certs.CA, Cert: certs.ServerCert, Key: certs.ServerKey}})
	if err != nil {
		t.Fatal(err)
	}
	srv := startNATS(t, res.ConfigFile)
	seeds := map[string]string{}
	for _, id := range res.Identities {
		seeds[id.Name] = id.SeedFile
	}
	bin := imagefleetBinary(t)
	as := func(identity string, args ...string) []string {
		return append([]string{"--nats", "tls://" + srv.addr, "--nkey", seeds[identity], "--tls-ca", certs.CA,
			"--tls-cert", certs.ClientCert, "--tls-key", certs.ClientKey, "--timeout", "10s"}, args...)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	out, err := cli(ctx, bin, as(node, "bus", "init")...)
	if err == nil || !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
		t.Fatalf("bus init with a node identity: err %v, output %s; want a permissions violation", err, out)
	}
	out, err = cli(ctx, bin, as(natsconf.RoleAdmin, "bus", "init")...)
	if err != nil {
		t.Fatalf("bus init with the admin identity: %v\n%s", err, out)
	}
	for _, s := range []string{events.EventsStream, events.PullStream, events.PullPartitionStream(0), events.PullPartitionStream(events.PullPartitions - 1), events.DeadLetterStream, "KV_" + events.RecordsBucket, "KV_" + events.PodsBucket, "KV_" + events.KubeEventsBucket, "KV_" + events.GCLeaseBucket} {
		if !strings.Contains(string(out), s) {
			t.Errorf("bus init output lacks %s:\n%s", s, out)
		}
	}

	rt := hollow.New(hollow.Options{Name: node})
	if _, err := rt.AddImage(cri.Image{ID: "sha256:" + strings.Repeat("a", 64), RepoTags: []string{"registry.example/app:1"},
		Size: 10 << 20}); err != nil {
		t.Fatal(err)
	}
	endpoint, stop, err := rt.StartUnix(ctx, filepath.Join(dir, "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	// A byte quota: the hollow runtime's image filesystem is not a real one (the gc pass below measures it).
	agent := startProc(t, "agent", bin, as(node, "agent", "--node", node, "--cri", endpoint,
		"--data-dir", filepath.Join(dir, "agent"), "--image-fs-capacity", "1Gi")...)
	defer agent.stop(syscall.SIGTERM)

	bustest.Eventually(t, "the agent's records over its node identity", time.Minute, func() error {
		var recs []events.ImageRecord
		if err := cliJSON(t, bin, &recs, as(node, "records", "--node", node)...); err != nil {
			return err
		}
		if len(recs) != 1 || recs[0].Size != 10<<20 {
			return fmt.Errorf("records %+v, want the one image", recs)
		}
		return nil
	})
	bustest.Eventually(t, "the agent's heartbeat", time.Minute, func() error {
		var nodes []struct {
			Node  string `json:"node"`
			State string `json:"state"`
		}
		if err := cliJSON(t, bin, &nodes, as(natsconf.RoleAdmin, "fleet", "nodes")...); err != nil {
			return err
		}
		if len(nodes) != 1 || nodes[0].Node != node || nodes[0].State != "Ready" {
			return fmt.Errorf("nodes %+v, want %s Ready", nodes, node)
		}
		return nil
	})
	// A GC pass takes the node's GC pass lease with the node's identity (create, renew, release).
	if out, err := cli(ctx, bin, as(natsconf.RoleAdmin, "gc", "--node", node)...); err != nil {
		t.Fatalf("gc: %v\n%s", err, out)
	}
	if log, err := os.ReadFile(agent.log); err != nil {
		t.Fatal(err)
	} else if bytes.Contains(bytes.ToLower(log), []byte("permissions violation")) {
		t.Errorf("the agent hit a permissions violation:\n%s", tail(agent.log, 40))
	} else if bytes.Contains(log, []byte("lease unavailable")) {
		t.Errorf("the agent's GC pass ran without its lease:\n%s", tail(agent.log, 40))
	}
}
