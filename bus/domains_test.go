package bus_test

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
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// startLeafLayout starts a hub (JetStream domain "hub") and one leaf nats-server per domain, each a leaf
// node of the hub with a JetStream domain of its own and the pull subjects kept local (as
// deploy/nats/leaf-edge.conf), and waits until every leaf is connected.
func startLeafLayout(t *testing.T, leaves ...string) (hub *bus.Server, edge map[string]*bus.Server) {
	t.Helper()
	dir := t.TempDir()
	start := func(name, conf string) *bus.Server {
		path := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: path, Listen: "127.0.0.1:-1",
			StoreDir: filepath.Join(dir, name), ServerName: name})
		if err != nil {
			t.Fatalf("start %s: %v", name, err)
		}
		t.Cleanup(srv.Shutdown)
		return srv
	}
	leafPort := testport.Free(t)
	hub = start("hub", fmt.Sprintf("jetstream { domain: hub }\nleafnodes { listen: \"127.0.0.1:%d\" }\n", leafPort))
	edge = map[string]*bus.Server{}
	for _, d := range leaves {
		edge[d] = start(d, fmt.Sprintf(`jetstream { domain: %q }
leafnodes { remotes: [ { urls: [ "nats-leaf://127.0.0.1:%d" ], deny_imports: [ "imagefleet.cmd.*.pull", "imagefleet.cmd.*.pull.*" ] } ] }
`, d, leafPort))
	}
	bustest.WaitFor(t, "every leaf connected to the hub", func() bool { return hub.NumLeafNodes() == len(leaves) })
	return hub, edge
}

func connect(t *testing.T, srv *bus.Server, o bus.Options) *bus.Bus {
	t.Helper()
	o.Name = t.Name()
	b, err := bus.Connect(t.Context(), srv.ClientURL(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// TestLeafDomains: an agent's bus on a leaf with JSDomain "hub" keeps the fleet-wide streams and buckets in
// the hub's domain and its pull work queues and node buckets in the leaf's; its events reach the hub's
// stream; a pull request the hub addresses to the leaf's domain lands in that leaf's queue only, under the
// node's plain subject, and the node's consumer gets it; a plain pull subject does not cross the link.
func TestLeafDomains(t *testing.T) {
	ctx := t.Context()
	hub, edge := startLeafLayout(t, "leaf-a", "leaf-b")
	hb := connect(t, hub, bus.Options{})
	if err := hb.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	agents := map[string]*bus.Bus{}
	for d, srv := range edge {
		a := connect(t, srv, bus.Options{JSDomain: "hub"})
		if a.PullDomain() != d || a.JSDomain() != "hub" {
			t.Fatalf("agent on %s: PullDomain %q, JSDomain %q", d, a.PullDomain(), a.JSDomain())
		}
		if err := a.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
			t.Fatalf("ensure streams on %s: %v", d, err)
		}
		agents[d] = a
	}
	if hb.PullDomain() != "" {
		t.Errorf("hub client: PullDomain %q, want none", hb.PullDomain())
	}
	// The same JSDomain on a hub connection: one domain, nothing split.
	if h := connect(t, hub, bus.Options{JSDomain: "hub"}); h.PullDomain() != "" {
		t.Errorf("hub client with JSDomain hub: PullDomain %q, want none", h.PullDomain())
	}

	// The agent lists the streams it uses, each once: the hub's fleet-wide ones and its leaf's pull queues.
	used, err := agents["leaf-a"].StreamNames(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{events.EventsStream, events.PullStream, events.PullStream + "_00"} {
		if n := len(slices.DeleteFunc(slices.Clone(used), func(u string) bool { return u != s })); n != 1 {
			t.Errorf("the agent's stream list %v has %s %d times, want once", used, s, n)
		}
	}
	// Where each stream is: read with plain connections to each server (their own domain only).
	leafA := connect(t, edge["leaf-a"], bus.Options{})
	hubNames, err := hb.StreamNames(ctx)
	if err != nil {
		t.Fatal(err)
	}
	leafNames, err := leafA.StreamNames(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{events.EventsStream, events.PodsStream, events.DeadLetterStream} {
		if !slices.Contains(hubNames, s) || slices.Contains(leafNames, s) {
			t.Errorf("%s: in the hub %v, in leaf-a %v; want the hub only", s, slices.Contains(hubNames, s), slices.Contains(leafNames, s))
		}
	}
	var pulls []string
	for _, s := range leafNames {
		if strings.HasPrefix(s, events.PullStream) {
			pulls = append(pulls, s)
		}
	}
	if !slices.Contains(pulls, events.PullStream) {
		t.Fatalf("leaf-a's streams %v: no pull work queue", leafNames)
	}

	// Events of a node on each leaf are stored in the hub's stream.
	for d, a := range agents {
		ev, err := events.New("node-"+d, events.EntityImage, "detected", map[string]string{"id": "sha256:" + d})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Publish(ctx, ev); err != nil {
			t.Fatalf("publish an event from %s: %v", d, err)
		}
	}
	if info, err := hb.Stream(ctx, events.EventsStream); err != nil || info.Messages != 2 {
		t.Fatalf("hub's events stream: %+v, %v; want the 2 events of both leaves", info, err)
	}

	// A fleet-wide bucket opened on a leaf is the hub's (Put and the raw puts of Batch); a node bucket is
	// the leaf's.
	nodes, err := agents["leaf-a"].KV(ctx, bus.KVConfig{Bucket: events.NodesBucket})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nodes.Put(ctx, "node-a", []byte("alive")); err != nil {
		t.Fatalf("put to the hub's registry from leaf-a: %v", err)
	}
	if err := nodes.Batch(ctx, map[string][]byte{"node-a2": []byte("alive")}, nil); err != nil {
		t.Fatalf("batch to the hub's registry from leaf-a: %v", err)
	}
	hubNodes, err := hb.KVExisting(ctx, events.NodesBucket)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"node-a", "node-a2"} {
		if v, _, err := hubNodes.Get(ctx, k); err != nil || string(v) != "alive" {
			t.Errorf("hub's registry %s: %q, %v", k, v, err)
		}
	}
	records, err := agents["leaf-a"].KV(ctx, bus.KVConfig{Bucket: events.RecordsBucket, Description: events.RecordsBucketDescription})
	if err != nil {
		t.Fatal(err)
	}
	if err := records.Batch(ctx, map[string][]byte{"node-a.x": []byte("r")}, nil); err != nil {
		t.Fatalf("batch to leaf-a's records: %v", err)
	}
	if _, err := leafA.KVExisting(ctx, events.RecordsBucket); err != nil {
		t.Errorf("records bucket not in leaf-a's domain: %v", err)
	}
	if _, err := hb.KVExisting(ctx, events.RecordsBucket); err == nil {
		t.Errorf("records bucket of a leaf's node made in the hub's domain")
	}
	// The hub reads and writes them through a view of leaf-a's domain (imagefleet records at the hub).
	view, err := hb.InDomain("leaf-a")
	if err != nil {
		t.Fatal(err)
	}
	viewRecords, err := view.KVExisting(ctx, events.RecordsBucket)
	if err != nil {
		t.Fatalf("leaf-a's records from the hub: %v", err)
	}
	if err := viewRecords.Batch(ctx, map[string][]byte{"node-a.y": []byte("r2")}, nil); err != nil {
		t.Fatalf("batch to leaf-a's records from the hub: %v", err)
	}
	for k, want := range map[string]string{"node-a.x": "r", "node-a.y": "r2"} {
		if v, _, err := viewRecords.Get(ctx, k); err != nil || string(v) != want {
			t.Errorf("leaf-a's record %s read from the hub: %q, %v; want %q", k, v, err, want)
		}
	}
	view.Close() // a view shares the hub connection: closing it leaves that open
	if !hb.Connected() {
		t.Fatal("closing a view closed its connection")
	}
	if same, _ := agents["leaf-a"].InDomain("leaf-a"); same != agents["leaf-a"] {
		t.Error("InDomain of the connection's own node domain is not the connection itself")
	}

	// Pull requests: addressed to leaf-a's domain from the hub, stored in leaf-a only, as the plain subject.
	node := "node-a"
	plain := events.CommandSubject(node, events.VerbPull)
	if _, err := hb.PublishCommand(ctx, events.DomainSubject("leaf-a", plain), "req-1", events.PullRequest{ID: "req-1", Image: "busybox"}, nil); err != nil {
		t.Fatalf("hub publishes to leaf-a's domain: %v", err)
	}
	got := make(chan string, 1)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- agents["leaf-a"].Consume(cctx, bus.ConsumerConfig{Stream: events.PullStream, Durable: events.PullerDurable(node),
			FilterSubjects: []string{plain}, MaxAckPending: 1}, func(_ context.Context, m *bus.Msg) error {
			select {
			case got <- m.Subject:
			default:
			}
			return nil
		})
	}()
	select {
	case s := <-got:
		if s != plain {
			t.Errorf("node's consumer on leaf-a got %s, want %s", s, plain)
		}
	case <-time.After(bustest.Timeout):
		t.Fatal("the request addressed to leaf-a did not reach the node's consumer there")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("consume: %v", err)
	}
	leafB := connect(t, edge["leaf-b"], bus.Options{})
	if info, err := leafB.Stream(ctx, events.PullStream); err != nil || info.LastSeq != 0 {
		t.Errorf("leaf-b's pull queue: %+v, %v; want nothing stored", info, err)
	}
	// The plain subject from the hub reaches no leaf: the hub's own queue takes it (nodes on the hub).
	if _, err := hb.PublishCommand(ctx, plain, "req-2", events.PullRequest{ID: "req-2", Image: "busybox"}, nil); err != nil {
		t.Fatal(err)
	}
	for d, c := range map[string]*bus.Bus{"leaf-a": leafA, "leaf-b": leafB} {
		if info, err := c.Stream(ctx, events.PullStream); err != nil || info.LastSeq > 1 {
			t.Errorf("%s's pull queue after a plain publish at the hub: %+v, %v", d, info, err)
		}
	}
	if info, err := hb.Stream(ctx, events.PullStream); err != nil || info.Messages != 1 {
		t.Errorf("hub's own pull queue: %+v, %v; want the plain request", info, err)
	}
}
