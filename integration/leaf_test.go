package integration_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// leafLayout is docs/scale.md's leaf-node layout at small scale, from deploy/nats/leaf-hub.conf and
// leaf-edge.conf (TLS on the leaf connections with test certificates): a hub in JetStream domain "hub" and
// one leaf nats-server per zone, each in a domain of its own.
type leafLayout struct {
	hub    *bus.Server
	leaves map[string]*bus.Server // by domain
	b      *bus.Bus               // a client of the hub
}

// startLeafLayout starts the hub and a leaf per domain (embedded nats-servers from the deploy configs) and
// waits until every leaf is connected to the hub.
func startLeafLayout(t testing.TB, domains ...string) *leafLayout {
	t.Helper()
	certs, err := natsconf.GenerateCerts(t.TempDir(), nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certPaths := []string{
		"/etc/imagefleet/tls/server.pem", certs.ServerCert, "/etc/imagefleet/tls/server-key.pem", certs.ServerKey,
		"/etc/imagefleet/tls/client.pem", certs.ClientCert, "/etc/imagefleet/tls/client-key.pem", certs.ClientKey,
		"/etc/imagefleet/tls/ca.pem", certs.CA,
	}
	dir := t.TempDir()
	render := func(src, name string, repl ...string) string {
		raw, err := os.ReadFile(filepath.Join("..", "deploy", "nats", src))
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(out, []byte(strings.NewReplacer(append(certPaths, repl...)...).Replace(string(raw))), 0o600); err != nil {
			t.Fatal(err)
		}
		return out
	}
	start := func(name, conf string) *bus.Server {
		srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf, Listen: "127.0.0.1:-1",
			StoreDir: filepath.Join(dir, name), ServerName: "imagefleet-" + name})
		if err != nil {
			t.Fatalf("start %s from %s: %v", name, conf, err)
		}
		t.Cleanup(srv.Shutdown)
		return srv
	}
	leafPort := freePort(t)
	l := &leafLayout{leaves: map[string]*bus.Server{}}
	l.hub = start("hub", render("leaf-hub.conf", "hub", `"0.0.0.0:7422"`, fmt.Sprintf(`"127.0.0.1:%d"`, leafPort)))
	t.Setenv("IMAGEFLEET_HUB_LEAF_URL", fmt.Sprintf("nats-leaf://127.0.0.1:%d", leafPort))
	for _, d := range domains {
		l.leaves[d] = start(d, render("leaf-edge.conf", d, `"edge-1"`, fmt.Sprintf("%q", d)))
	}
	bustest.WaitWithin(t, "every leaf connected to the hub", time.Minute, func() bool { return l.hub.NumLeafNodes() == len(domains) })
	b, err := bus.Connect(t.Context(), l.hub.ClientURL(), bus.Options{Name: "leaf-test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	l.b = b
	return l
}

// leafTraffic reads what crossed the hub's leaf connections so far.
func (l *leafLayout) leafTraffic(t testing.TB) bus.LeafTraffic {
	t.Helper()
	tr, err := l.hub.LeafTraffic()
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// pullQueues sums, over the pull work queues of the server c is connected to (its own domain), the
// requests ever stored.
func pullQueues(ctx context.Context, c *bus.Bus) (uint64, error) {
	names, err := c.StreamNames(ctx)
	if err != nil {
		return 0, err
	}
	var stored uint64
	for _, n := range names {
		if n != events.PullStream && !strings.HasPrefix(n, events.PullStream+"_") {
			continue
		}
		info, err := c.Stream(ctx, n)
		if err != nil {
			return 0, err
		}
		stored += info.LastSeq
	}
	return stored, nil
}

// TestLeafDomainsFleetRollouts: a hub and two leaf domains from the deploy configs, three hollow agents with
// the real workers on each leaf (imagefleet hollow --js-domain hub), and a fleet GC and a fleet pre-pull
// started at the hub: both reach the six nodes across the leaf connections and complete, each node acts
// once (its result events stored in the hub's stream), every pull request (and one `imagefleet pull --node`
// at the hub) is stored once, in the node's own leaf domain, and none in the hub's queues.
func TestLeafDomainsFleetRollouts(t *testing.T) {
	const perLeaf, images = 3, 4
	ctx := t.Context()
	bin := imagefleetBinary(t)
	domains := []string{"leaf-a", "leaf-b"}
	l := startLeafLayout(t, domains...)
	hubURL := l.hub.ClientURL()

	// docs/operations.md's steps: bus init at the hub (startLeafLayout), then at each site with the hub's
	// domain; the site's pull queues take the subject addressed to its domain.
	for _, d := range domains {
		ictx, cancel := context.WithTimeout(ctx, time.Minute)
		_, err := cli(ictx, bin, "bus", "init", "--nats", l.leaves[d].ClientURL(), "--js-domain", "hub")
		cancel()
		if err != nil {
			t.Fatalf("bus init at %s: %v", d, err)
		}
	}
	var hollows []*proc
	for i, d := range domains {
		hollows = append(hollows, startHollow(t, bin, "hollow-"+d, l.leaves[d].ClientURL(), perLeaf,
			"--first", fmt.Sprint(i*perLeaf), "--last", fmt.Sprint(len(domains)*perLeaf), "--js-domain", "hub",
			"--images-per-node", fmt.Sprint(images), "--heartbeat-period", "1s"))
	}
	nodes, waited := waitReady(t, l.b, hollows[0], "hollow-", len(domains)*perLeaf, 2*time.Minute)
	t.Logf("%d hollow nodes on 2 leaf domains Ready in the hub's registry after %s", len(nodes), waited.Round(time.Millisecond))

	// A real agent with the default workers (journal, detector, cache, heartbeat, removals, gc, pod index,
	// puller) on leaf-a, its runtime a hollow one on a unix socket, and the inventory at the hub.
	const siteNode, siteTag = "site-a-node", "registry.example/site/app:1"
	rt := hollow.New(hollow.Options{Name: siteNode})
	if _, err := rt.AddImage(cri.Image{RepoTags: []string{siteTag}, Size: 10 << 20}); err != nil {
		t.Fatal(err)
	}
	endpoint, stopRT, err := rt.StartUnix(ctx, filepath.Join(t.TempDir(), "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopRT)
	site := startProc(t, "agent-"+siteNode, bin, "agent", "--node", siteNode, "--cri", endpoint, "--nats", l.leaves["leaf-a"].ClientURL(),
		"--js-domain", "hub", "--data-dir", t.TempDir(), "--image-fs-capacity", "1Gi", "--minimum-image-ttl-duration", "0s",
		"--heartbeat-period", "1s", "--image-detect-period", "1s")
	startProc(t, "inventory", bin, "agent", "--node", "inventory-1", "--nats", hubURL, "--workers", "inventory",
		"--data-dir", t.TempDir(), "--no-journal")
	waitReady(t, l.b, site, siteNode, 1, time.Minute)
	nodes = append(nodes, siteNode)
	slices.Sort(nodes)
	n := len(nodes)
	bustest.Eventually(t, "the site agent's image in the hub's inventory and its records at the site", time.Minute, func() error {
		where, err := whereNodes(t, bin, hubURL, siteTag)
		if err != nil {
			return err
		}
		if !slices.Equal(where, []string{siteNode}) {
			return fmt.Errorf("fleet where %s: %v", siteTag, where)
		}
		recs, err := nodeRecords(t, bin, hubURL, siteNode)
		if err != nil {
			return err
		}
		if !slices.Equal(recs, []string{siteTag}) {
			return fmt.Errorf("records %v", recs)
		}
		return nil
	})

	// Each node reports its leaf's domain.
	reg, err := fleet.OpenRegistry(ctx, l.b, fleet.RegistryOptions{})
	if err != nil {
		t.Fatal(err)
	}
	listed, err := reg.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, nd := range listed {
		var want string // the inventory, at the hub
		var i int
		switch _, err := fmt.Sscanf(nd.Node, "hollow-%05d", &i); {
		case err == nil:
			want = domains[i/perLeaf]
		case nd.Node == siteNode:
			want = "leaf-a"
		}
		if nd.JSDomain != want {
			t.Errorf("node %s reports domain %q, want %q", nd.Node, nd.JSDomain, want)
		}
	}

	// A fleet GC from the hub: core requests to each node's executor across the leaf connections.
	before, err := streamEnd(ctx, l.b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	link := l.leafTraffic(t)
	began := time.Now()
	var gcRes events.RolloutResult
	if err := cliJSON(t, bin, &gcRes, "fleet", "gc", "--all-unused", "--nats", hubURL); err != nil {
		t.Fatal(err)
	}
	gcWall, gcLink := time.Since(began), l.leafTraffic(t)
	if gcRes.Succeeded != n || len(gcRes.Failed) != 0 {
		t.Fatalf("fleet gc: %d succeeded, failed %v", gcRes.Succeeded, gcRes.Failed)
	}
	for _, nr := range gcRes.Nodes {
		want := images
		if nr.Node == siteNode {
			want = 1
		}
		if nr.GC == nil || len(nr.GC.Removed) != want {
			t.Fatalf("node %s: gc result %+v", nr.Node, nr.GC)
		}
	}
	bustest.Eventually(t, "one gc.finished event of each node in the hub's stream", time.Minute, func() error {
		counts, err := gcFinishedPerNode(ctx, l.b, before, false)
		if err != nil {
			return err
		}
		if bad := onceEach(nodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})

	// A fleet pre-pull from the hub: each request addressed to its node's leaf domain.
	const image = "registry.local/leaf/app:v1"
	before, err = streamEnd(ctx, l.b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	hubQueued, err := pullQueues(ctx, l.b)
	if err != nil {
		t.Fatal(err)
	}
	link2 := l.leafTraffic(t)
	began = time.Now()
	var pullRes events.RolloutResult
	if err := cliJSON(t, bin, &pullRes, "fleet", "pull", image, "--nats", hubURL); err != nil {
		t.Fatal(err)
	}
	pullWall, pullLink := time.Since(began), l.leafTraffic(t)
	if pullRes.Succeeded != n || len(pullRes.Failed) != 0 {
		t.Fatalf("fleet pull: %d succeeded, failed %v", pullRes.Succeeded, pullRes.Failed)
	}
	bustest.Eventually(t, "one pull result of each node in the hub's stream", time.Minute, func() error {
		counts, err := pullResultsPerNode(ctx, l.b, before, pullRes.ID)
		if err != nil {
			return err
		}
		if bad := onceEach(nodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})
	// One node's pull queued at the hub (imagefleet pull) finds the node's domain in the registry.
	one := fmt.Sprintf("hollow-%05d", len(domains)*perLeaf-1) // on leaf-b
	var single struct {
		Node     string `json:"node"`
		ImageRef string `json:"imageRef"`
		Error    string `json:"error"`
	}
	if err := cliJSON(t, bin, &single, "pull", "--node", one, "--wait", "--wait-timeout", "1m", "registry.local/leaf/one:v1", "--nats", hubURL); err != nil {
		t.Fatal(err)
	}
	if single.Node != one || single.ImageRef == "" || single.Error != "" {
		t.Fatalf("imagefleet pull --node %s from the hub: %+v", one, single)
	}
	if q, err := pullQueues(ctx, l.b); err != nil || q != hubQueued {
		t.Errorf("the hub's pull queues stored %d requests (%v); want none", q-hubQueued, err)
	}
	for _, d := range domains {
		c, err := bus.Connect(ctx, l.leaves[d].ClientURL(), bus.Options{Name: "leaf-test-" + d})
		if err != nil {
			t.Fatal(err)
		}
		q, err := pullQueues(ctx, c)
		c.Close()
		want := uint64(perLeaf) + 1 // leaf-a: the site agent's; leaf-b: the single pull
		if err != nil || q != want {
			t.Errorf("%s's pull queues stored %d requests (%v); want %d", d, q, err, want)
		}
	}
	if t.Failed() {
		return
	}
	perNode := func(a, b bus.LeafTraffic) string {
		return fmt.Sprintf("%.1f msgs/node (%.1f to the leaves, %.1f from them), %.0f bytes/node",
			float64(b.OutMsgs+b.InMsgs-a.OutMsgs-a.InMsgs)/float64(n), float64(b.OutMsgs-a.OutMsgs)/float64(n),
			float64(b.InMsgs-a.InMsgs)/float64(n), float64(b.OutBytes+b.InBytes-a.OutBytes-a.InBytes)/float64(n))
	}
	t.Logf("fleet gc across 2 leaf domains, %d nodes: %s wall, leaf links %s", n, gcWall.Round(time.Millisecond), perNode(link, gcLink))
	t.Logf("fleet pull across 2 leaf domains, %d nodes: %s wall, leaf links %s", n, pullWall.Round(time.Millisecond), perNode(link2, pullLink))
}
