package integration_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/gc"
)

// securedSites is the leaf layout with the configs `imagefleet bus gen-creds` writes for it (TLS with client
// certificates on every client and leaf connection): a hub (domain "hub", the fleet, inventory and admin
// users, one leaf-only identity per site) and one server per site (its own domain, its nodes' users with
// their rights in both domains, its admin, its leaf connection to the hub with the site's identity).
type securedSites struct {
	certs natsconf.Certs
	hub   *natsServer
	sites map[string]*natsServer
	// seeds[server][identity]: server "hub" or a site's domain.
	seeds map[string]map[string]string
}

func startSecuredSites(t *testing.T, nodes map[string][]string) *securedSites {
	t.Helper()
	dir := t.TempDir()
	certs, err := natsconf.GenerateCerts(filepath.Join(dir, "tls"), nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	serverTLS := &natsconf.TLSFiles{CA: certs.CA, Cert: certs.ServerCert, Key: certs.ServerKey}
	s := &securedSites{certs: certs, sites: map[string]*natsServer{}, seeds: map[string]map[string]string{}}
	var sites []string
	for d := range nodes {
		sites = append(sites, d)
	}
	leafPort := freePort(t)
	gen := func(server string, o natsconf.Options) string {
		res, err := natsconf.Generate(filepath.Join(dir, server), o)
		if err != nil {
			t.Fatalf("generate %s: %v", server, err)
		}
		s.seeds[server] = map[string]string{}
		for _, id := range res.Identities {
			s.seeds[server][id.Name] = id.SeedFile
		}
		return res.ConfigFile
	}
	s.hub = startNATS(t, gen("hub", natsconf.Options{Domain: "hub", Sites: sites, Listen: "127.0.0.1:4222",
		LeafListen: fmt.Sprintf("127.0.0.1:%d", leafPort), TLS: serverTLS}))
	for _, d := range sites {
		s.sites[d] = startNATS(t, gen(d, natsconf.Options{Nodes: nodes[d], Domain: d, JSDomain: "hub",
			Listen: "127.0.0.1:4222", TLS: serverTLS, LeafRemote: &natsconf.LeafRemote{
				URL: fmt.Sprintf("nats-leaf://127.0.0.1:%d", leafPort), SeedFile: s.seeds["hub"][d],
				TLS: &natsconf.TLSFiles{CA: certs.CA, Cert: certs.ClientCert, Key: certs.ClientKey}}}))
	}
	bustest.WaitWithin(t, "every site connected to the hub", time.Minute, func() bool {
		return s.hub.srv.NumLeafNodes() == len(sites)
	})
	return s
}

// args are the connection flags of identity on server ("hub" or a site's domain).
func (s *securedSites) args(server, identity string) []string {
	srv := s.hub
	if server != "hub" {
		srv = s.sites[server]
	}
	a := []string{"--nats", "tls://" + srv.addr, "--nkey", s.seeds[server][identity], "--tls-ca", s.certs.CA,
		"--tls-cert", s.certs.ClientCert, "--tls-key", s.certs.ClientKey, "--timeout", "10s"}
	if server != "hub" {
		a = append(a, "--js-domain", "hub")
	}
	return a
}

func (s *securedSites) connect(t *testing.T, server, identity string) *bus.Bus {
	t.Helper()
	srv, o := s.hub, bus.Options{}
	if server != "hub" {
		srv, o.JSDomain = s.sites[server], "hub"
	}
	o.Name, o.NKeyFile, o.ConnectTimeout = "test-"+identity, s.seeds[server][identity], 5*time.Second
	o.TLSCA, o.TLSCert, o.TLSKey = s.certs.CA, s.certs.ClientCert, s.certs.ClientKey
	b, err := bus.Connect(t.Context(), "tls://"+srv.addr, o)
	if err != nil {
		t.Fatalf("connect to %s as %s: %v", server, identity, err)
	}
	t.Cleanup(b.Close)
	return b
}

// TestLeafSecurityNodeIsolation: the leaf layout secured by gen-creds' per-node identities. After `bus init`
// with the admin at the hub and at each site, agents with the default workers run on the sites with their
// node identities and hit no permissions violation; a fleet GC and a fleet pre-pull started at the hub with
// the fleet identity complete on every node. Then node A on leaf-a is refused, in the site's domain, the
// hub's and the other site's, what TestSecurityNodeIsolation refuses it on one server: B's (same site) and
// C's (other site) events, commands, pull queues and consumers, records, registry keys, other users'
// replies, and stream changes. A site's identity authenticates only its leaf connection, not a client. An
// ImageGCPolicy the fleet identity writes and announces at the hub reaches node A's agent at its site.
func TestLeafSecurityNodeIsolation(t *testing.T) {
	const nodeA, nodeB, nodeC = "site-a-1", "site-a-2", "site-b-1"
	const images = 2
	if events.PullStreamOf(nodeA) == events.PullStreamOf(nodeB) {
		t.Fatalf("nodes %s and %s share pull partition %s: the cross-partition cases need two", nodeA, nodeB, events.PullStreamOf(nodeA))
	}
	nodes := map[string][]string{"leaf-a": {nodeA, nodeB}, "leaf-b": {nodeC}}
	siteOf := map[string]string{nodeA: "leaf-a", nodeB: "leaf-a", nodeC: "leaf-b"}
	s := startSecuredSites(t, nodes)
	bin := imagefleetBinary(t)
	ctx := t.Context()

	// docs/operations.md's steps with the generated identities: bus init with the hub's admin at the hub,
	// with each site's admin at the site.
	for _, server := range []string{"hub", "leaf-a", "leaf-b"} {
		ictx, cancel := context.WithTimeout(ctx, time.Minute)
		out, err := cli(ictx, bin, append([]string{"bus", "init"}, s.args(server, natsconf.RoleAdmin)...)...)
		cancel()
		if err != nil {
			t.Fatalf("bus init at %s: %v\n%s", server, err, out)
		}
	}

	// One agent per node, default workers, its node identity, on its site's server.
	var agents []*proc
	for _, node := range []string{nodeA, nodeB, nodeC} {
		rt := hollow.New(hollow.Options{Name: node})
		for i := range images {
			if _, err := rt.AddImage(cri.Image{RepoTags: []string{fmt.Sprintf("registry.example/%s/app:%d", node, i)}, Size: 10 << 20}); err != nil {
				t.Fatal(err)
			}
		}
		endpoint, stopRT, err := rt.StartUnix(ctx, filepath.Join(t.TempDir(), "cri.sock"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stopRT)
		p := startProc(t, "agent-"+node, bin, append([]string{"agent", "--node", node, "--cri", endpoint,
			"--data-dir", t.TempDir(), "--image-fs-capacity", "1Gi", "--minimum-image-ttl-duration", "0s",
			"--image-detect-period", "1s"}, s.args(siteOf[node], node)...)...)
		agents = append(agents, p)
	}
	hubAdmin := s.connect(t, "hub", natsconf.RoleAdmin)
	for i, node := range []string{nodeA, nodeB, nodeC} {
		waitReady(t, hubAdmin, agents[i], node, 1, time.Minute)
	}

	// A fleet GC and a fleet pre-pull at the hub with the fleet identity reach every site's node.
	var gcRes events.RolloutResult
	if err := cliJSON(t, bin, &gcRes, append([]string{"fleet", "gc", "--all-unused"}, s.args("hub", natsconf.RoleFleet)...)...); err != nil {
		t.Fatal(err)
	}
	if gcRes.Succeeded != 3 || len(gcRes.Failed) != 0 {
		t.Fatalf("fleet gc: %d succeeded, failed %v", gcRes.Succeeded, gcRes.Failed)
	}
	for _, nr := range gcRes.Nodes {
		if nr.GC == nil || len(nr.GC.Removed) != images {
			t.Errorf("node %s: gc result %+v, want %d images removed", nr.Node, nr.GC, images)
		}
	}
	var pullRes events.RolloutResult
	if err := cliJSON(t, bin, &pullRes, append([]string{"fleet", "pull", "registry.local/leaf/app:v1"}, s.args("hub", natsconf.RoleFleet)...)...); err != nil {
		t.Fatal(err)
	}
	if pullRes.Succeeded != 3 || len(pullRes.Failed) != 0 {
		t.Fatalf("fleet pull: %d succeeded, failed %v", pullRes.Succeeded, pullRes.Failed)
	}
	// The site's admin reads a node's records in the site's domain.
	bustest.Eventually(t, "the pulled image in node A's records at its site", time.Minute, func() error {
		var recs []events.ImageRecord
		if err := cliJSON(t, bin, &recs, append([]string{"records", "--node", nodeA}, s.args("leaf-a", natsconf.RoleAdmin)...)...); err != nil {
			return err
		}
		for _, r := range recs {
			if strings.Contains(strings.Join(r.RepoTags, ","), "registry.local/leaf/app:v1") {
				return nil
			}
		}
		return fmt.Errorf("records %+v", recs)
	})
	// An ImageGCPolicy written at the hub by the fleet identity, with its notice, reaches node A's running
	// agent at its site (the notice crosses the leaf connection; the agent reads its key in the hub's
	// domain), and only node A's.
	fleetBus := s.connect(t, "hub", natsconf.RoleFleet)
	policies, err := fleetBus.KV(ctx, gc.PolicyBucketConfig())
	if err != nil {
		t.Fatal(err)
	}
	revs, err := policies.BatchRevisions(ctx, map[string][]byte{events.NodeToken(nodeA): []byte(`{"sources":[{"name":"site-policy","generation":1}]}`)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := fleetBus.AnnounceRevision(events.GCPolicyNotice(nodeA), revs[events.NodeToken(nodeA)]); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "node A's dry run under site-policy/1, the others under none", time.Minute, func() error {
		var dry events.RolloutResult
		if err := cliJSON(t, bin, &dry, append([]string{"fleet", "gc", "--dry-run", "--all-unused"}, s.args("hub", natsconf.RoleFleet)...)...); err != nil {
			return err
		}
		for _, nr := range dry.Nodes {
			if nr.GC == nil {
				return fmt.Errorf("node %s: no gc result", nr.Node)
			}
			want := ""
			if nr.Node == nodeA {
				want = "site-policy/1"
			}
			if got := (events.GCPolicy{Sources: nr.GC.Policies}).Names(); got != want {
				return fmt.Errorf("node %s applied %q, want %q", nr.Node, got, want)
			}
		}
		return nil
	})
	for _, p := range agents {
		p.stop(syscall.SIGTERM)
		raw, err := os.ReadFile(p.log)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(raw), "\n") {
			// The one refusal a node meets by design (docs/security.md, "Known limits"): nats.go's ordered
			// consumer deletes its previous consumer at each fetch (a read of the events stream past the
			// node's own events), and a node may not delete consumers of the events stream, which holds other
			// workers' durables; the server drops the ordered consumer when it goes inactive.
			if strings.Contains(line, `Permissions Violation for Publish to \"$JS.hub.API.CONSUMER.DELETE.`+events.EventsStream+`.`) {
				continue
			}
			if strings.Contains(strings.ToLower(line), "permissions violation") {
				t.Errorf("%s hit a permissions violation: %s", p.name, line)
			}
			if strings.Contains(line, "lease unavailable") {
				t.Errorf("%s's GC pass ran without its lease: %s", p.name, line)
			}
		}
	}
	if t.Failed() {
		return
	}

	a := s.connect(t, "leaf-a", nodeA)
	bb := s.connect(t, "leaf-a", nodeB)
	c := s.connect(t, "leaf-b", nodeC)
	siteAdmin := s.connect(t, "leaf-a", natsconf.RoleAdmin)

	// B and C serve their gc; nothing A does may reach them.
	var served atomic.Int64
	serveCtx, stopServe := context.WithCancel(ctx)
	defer stopServe()
	for _, x := range []struct {
		b    *bus.Bus
		node string
	}{{bb, nodeB}, {c, nodeC}} {
		go func() {
			_ = x.b.Serve(serveCtx, events.CommandSubject(x.node, events.VerbGC), "gc", func(context.Context, []byte) (any, error) {
				served.Add(1)
				return "ran", nil
			})
		}()
		waitServing(t, hubAdmin, events.CommandSubject(x.node, events.VerbGC))
	}

	t.Run("own events to the hub's stream, not another node's", func(t *testing.T) {
		ev, _ := events.New(nodeA, events.EntityImage, events.ActionDetected, nil)
		if err := a.Publish(ctx, ev); err != nil {
			t.Fatalf("publish own event: %v", err)
		}
		if got := storedEventIDs(t, ctx, hubAdmin, events.NodeEvents(nodeA)); got[ev.ID] != 1 {
			t.Errorf("A's event stored %d times in the hub's stream, want 1", got[ev.ID])
		}
		for _, other := range []string{nodeB, nodeC} {
			ev, _ := events.New(other, events.EntityImage, events.ActionRemoved, nil)
			c, cancel := short(t)
			wantViolation(t, "publish "+other+"'s event", a.Publish(c, ev))
			cancel()
			if got := storedEventIDs(t, ctx, hubAdmin, events.NodeEvents(other)); got[ev.ID] != 0 {
				t.Errorf("%s's event forged by A was stored", other)
			}
		}
	})
	t.Run("command another node", func(t *testing.T) {
		base := served.Load()
		for _, other := range []string{nodeB, nodeC} {
			c, cancel := short(t)
			wantViolation(t, "A requests "+other+"'s gc", a.Request(c, events.CommandSubject(other, events.VerbGC), nil, nil))
			cancel()
			for _, subj := range []string{events.PullSubject(other), events.DomainSubject(siteOf[other], events.PullSubject(other))} {
				c, cancel := short(t)
				_, err := a.PublishCommand(c, subj, "", map[string]string{"image": "x"}, nil)
				cancel()
				wantViolation(t, "A queues a pull on "+subj, err)
			}
		}
		if n := served.Load() - base; n != 0 {
			t.Errorf("B and C ran %d commands sent by A", n)
		}
	})
	t.Run("read another node's commands or other users' replies", func(t *testing.T) {
		// A subtest each: a subject whose violation never comes ends its own subtest (waitViolation's
		// Fatal), the subscription is stopped on the way out, and the other subject is still checked.
		for _, subject := range []string{"imagefleet.cmd." + events.NodeToken(nodeB) + ".>", "_INBOX.>"} {
			t.Run(subject, func(t *testing.T) {
				subCtx, cancel := context.WithCancel(ctx)
				done := make(chan struct{})
				defer func() { cancel(); <-done }()
				go func() {
					defer close(done)
					_ = a.Subscribe(subCtx, subject, func(string, map[string][]string, []byte) {})
				}()
				waitViolation(t, a, subject)
			})
		}
	})
	t.Run("pull queues: own only, in its site's domain", func(t *testing.T) {
		refused := func(t *testing.T, what string, on *bus.Bus, api, stream, durable, filter string) {
			t.Helper()
			c, cancel := short(t)
			defer cancel()
			cc := bus.ConsumerConfig{Stream: stream, Durable: durable}
			if filter != "" {
				cc.FilterSubjects = []string{filter}
			}
			if err := on.Consume(c, cc, func(context.Context, *bus.Msg) error { return nil }); err == nil {
				t.Fatalf("A created %s", what)
			}
			if filter != "" {
				waitViolation(t, a, api+"CONSUMER.CREATE."+stream+"."+durable+"."+filter)
			}
		}
		durA, durB, durC := events.PullerDurable(nodeA), events.PullerDurable(nodeB), events.PullerDurable(nodeC)
		refused(t, "B's consumer on B's partition", a, "$JS.API.", events.PullStreamOf(nodeB), durB, events.PullSubject(nodeB))
		refused(t, "a consumer on B's partition", a, "$JS.API.", events.PullStreamOf(nodeB), durA, events.PullSubject(nodeB))
		refused(t, "a consumer over its whole partition", a, "$JS.API.", events.PullStreamOf(nodeA), durA,
			events.PullPartitionSubjects(events.PullPartition(nodeA)))
		refused(t, "B's legacy consumer", a, "$JS.API.", events.PullStream, durB, events.LegacyPullSubject(nodeB))
		refused(t, "an unfiltered consumer on its partition", a, "$JS.API.", events.PullStreamOf(nodeA), durA+"-all", "")
		inB, err := a.InDomain("leaf-b")
		if err != nil {
			t.Fatal(err)
		}
		refused(t, "C's consumer in leaf-b's domain", inB, "$JS.leaf-b.API.", events.PullStreamOf(nodeC), durC, events.PullSubject(nodeC))
		inHub, err := a.InDomain("hub")
		if err != nil {
			t.Fatal(err)
		}
		refused(t, "a consumer of B's events in the hub's domain", inHub, "$JS.hub.API.", events.EventsStream,
			events.RemovalsDurable(nodeB), events.NodeEvents(nodeB))
	})
	t.Run("records: own only, in its site's domain", func(t *testing.T) {
		kv, err := a.KVExisting(ctx, events.RecordsBucket)
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
		other := events.NodeToken(nodeB) + ".sha256_1"
		c, cancel := short(t)
		defer cancel()
		if _, err := kv.Put(c, other, []byte("{}")); err == nil {
			t.Fatal("A wrote B's record")
		}
		waitViolation(t, a, "$KV."+events.RecordsBucket+"."+other)
		// C's records, in leaf-b's domain: neither read nor written.
		for _, subject := range []string{
			"$JS.leaf-b.API.DIRECT.GET.KV_" + events.RecordsBucket + ".$KV." + events.RecordsBucket + "." + events.NodeToken(nodeC) + ".sha256_1",
			"$JS.leaf-b.API.$KV." + events.RecordsBucket + "." + events.NodeToken(nodeC) + ".sha256_1",
		} {
			c, cancel := short(t)
			wantViolation(t, subject, a.Request(c, subject, []byte("{}"), nil))
			cancel()
		}
	})
	t.Run("GC pass lease: own only, in its site's domain", func(t *testing.T) {
		kvA, err := a.KVExisting(ctx, events.GCLeaseBucket)
		if err != nil {
			t.Fatal(err)
		}
		other := events.NodeToken(nodeB)
		c, cancel := short(t)
		if _, err := kvA.Create(c, other, []byte(`{"holder":"a"}`)); err == nil {
			t.Error("A took B's GC pass lease")
		}
		cancel()
		waitViolation(t, a, "$KV."+events.GCLeaseBucket+"."+other)
		c, cancel = short(t)
		if err := kvA.Delete(c, other); err == nil {
			t.Error("A released B's GC pass lease")
		}
		cancel()
	})
	t.Run("registry: own key only, in the hub's domain", func(t *testing.T) {
		kv, err := a.KVExisting(ctx, events.NodesBucket)
		if err != nil {
			t.Fatal(err)
		}
		// Its agent has stopped (its heartbeat key may be gone: not found is an answer, a refusal is not); the
		// last-seen key stays.
		if _, _, err := kv.Get(ctx, events.NodeToken(nodeA)); err != nil && !errors.Is(err, bus.ErrKeyNotFound) {
			t.Fatalf("A reads its own heartbeat: %v", err)
		}
		seen, err := a.KVExisting(ctx, events.NodesSeenBucket)
		if err != nil {
			t.Fatal(err)
		}
		if v, _, err := seen.Get(ctx, events.NodeToken(nodeA)); err != nil || len(v) == 0 {
			t.Fatalf("A reads its own last-seen key: %q %v", v, err)
		}
		for _, other := range []string{nodeB, nodeC} {
			c, cancel := short(t)
			if _, err := kv.Put(c, events.NodeToken(other), []byte("{}")); err == nil {
				t.Errorf("A wrote %s's heartbeat", other)
			}
			cancel()
			waitViolation(t, a, "$JS.hub.API.$KV."+events.NodesBucket+"."+events.NodeToken(other))
			c, cancel = short(t)
			if _, _, err := kv.Get(c, events.NodeToken(other)); err == nil {
				t.Errorf("A read %s's heartbeat", other)
			}
			cancel()
			waitViolation(t, a, "$JS.hub.API.DIRECT.GET.KV_"+events.NodesBucket+".$KV."+events.NodesBucket+"."+events.NodeToken(other))
		}
	})
	t.Run("no stream changes in any domain", func(t *testing.T) {
		for _, subject := range []string{"$JS.API.STREAM.CREATE.EVIL", "$JS.hub.API.STREAM.CREATE.EVIL",
			"$JS.hub.API.STREAM.DELETE." + events.EventsStream, "$JS.API.STREAM.DELETE." + events.PullStreamOf(nodeB),
			"$JS.leaf-b.API.STREAM.DELETE." + events.PullStreamOf(nodeC)} {
			c, cancel := short(t)
			wantViolation(t, subject, a.Request(c, subject, []byte("{}"), nil))
			cancel()
		}
		// The site's admin may (its leaf connection binds it to the hub's account).
		info, err := siteAdmin.Stream(ctx, events.EventsStream)
		if err != nil || info.Name != events.EventsStream {
			t.Errorf("the site's admin reads the hub's events stream: %+v %v", info, err)
		}
	})
	t.Run("a site's server reaches neither another site's domain nor its messages", func(t *testing.T) {
		// The hub reaches leaf-b's JetStream API; leaf-a's server (here its admin, who may do anything at the
		// site) does not, however its own users' permissions were set.
		c, cancel := short(t)
		if err := hubAdmin.Request(c, "$JS.leaf-b.API.INFO", nil, nil); err != nil {
			t.Errorf("the hub's admin asks leaf-b's JetStream API: %v", err)
		}
		cancel()
		c, cancel = short(t)
		if err := siteAdmin.Request(c, "$JS.leaf-b.API.INFO", nil, nil); err == nil {
			t.Error("leaf-a's admin reached leaf-b's JetStream API through the hub")
		}
		cancel()
		// A message addressed to leaf-b's domain reaches leaf-b, not leaf-a.
		const probe = events.DomainRoot + ".leaf-b.probe"
		bAdmin := s.connect(t, "leaf-b", natsconf.RoleAdmin)
		var atA, atB atomic.Int64
		subCtx, stop := context.WithCancel(ctx)
		defer stop()
		for _, x := range []struct {
			b *bus.Bus
			n *atomic.Int64
		}{{siteAdmin, &atA}, {bAdmin, &atB}} {
			sub, err := x.b.SubscribeSync(subCtx, events.DomainRoot+".leaf-b.>")
			if err != nil {
				t.Fatal(err)
			}
			go func() {
				for {
					if _, _, err := sub.Next(subCtx); err != nil {
						return
					}
					x.n.Add(1)
				}
			}()
		}
		bustest.Eventually(t, "the probe at leaf-b", 10*time.Second, func() error {
			if err := hubAdmin.PublishRaw(probe, []byte("probe")); err != nil {
				return err
			}
			if atB.Load() == 0 {
				return fmt.Errorf("not received at leaf-b")
			}
			return nil
		})
		if atA.Load() != 0 {
			t.Errorf("leaf-a received %d messages addressed to leaf-b's domain", atA.Load())
		}
		// Nothing was refused on the links themselves (that would have closed one).
		if n := s.hub.srv.NumLeafNodes(); n != 2 {
			t.Errorf("%d sites connected to the hub, want 2", n)
		}
	})
	t.Run("a site's identity is not a client's", func(t *testing.T) {
		o := bus.Options{Name: "site-as-client", NKeyFile: s.seeds["hub"]["leaf-a"], TLSCA: s.certs.CA,
			TLSCert: s.certs.ClientCert, TLSKey: s.certs.ClientKey, ConnectTimeout: time.Second}
		if b, err := bus.Connect(ctx, "tls://"+s.hub.addr, o); err == nil {
			b.Close()
			t.Error("a client connected to the hub with leaf-a's site identity")
		}
	})
}
