package fleet

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestPullDomainsWithoutASecondRegistryRead: a fleet pre-pull takes its nodes' JetStream domains from the
// plan's node records (WithNodeDomains), so starting its watch reads no registry entry; `imagefleet pull
// --node` reads only that node's entry (NodeDomain). Reads are counted as the messages the connection
// received: the registry of 300 nodes is 600 entries, which a full read receives one message each; the watch
// started without the plan's domains does that full read, and shows that the count would see one.
func TestPullDomainsWithoutASecondRegistryRead(t *testing.T) {
	ctx := t.Context()
	_, b := bustest.Start(t)
	if err := b.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	alive, seen, err := heartbeatBuckets(ctx, b, time.Hour, 1)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	const nodes = 300
	fulls := map[string][]byte{}
	for i := range nodes {
		info := events.NodeInfo{Node: fmt.Sprintf("node-%03d", i), Labels: map[string]string{"zone": []string{"a", "b"}[i%2]},
			Started: now, Heartbeat: now, Period: events.Duration{Duration: DefaultHeartbeatPeriod}}
		if i%3 == 0 {
			info.JSDomain = fmt.Sprintf("leaf-%d", i%4)
		}
		raw, _ := json.Marshal(info)
		fulls[events.NodeToken(info.Node)] = raw
	}
	if err := seen.Batch(ctx, fulls, nil); err != nil {
		t.Fatal(err)
	}
	if err := alive.Batch(ctx, fulls, nil); err != nil {
		t.Fatal(err)
	}
	received := func(f func()) uint64 {
		before := b.Stats().InMsgs
		f()
		return b.Stats().InMsgs - before
	}
	var p NodePlan
	if n := received(func() {
		if p, err = Plan(ctx, b, "zone=a", false, nil); err != nil {
			t.Fatal(err)
		}
	}); n < 2*nodes {
		t.Fatalf("the plan received %d messages, fewer than the registry's %d entries: the count misses reads", n, 2*nodes)
	}
	if len(p.Nodes) != nodes/2 || len(p.Domains) != nodes/6 {
		t.Fatalf("planned %d nodes with %d domains, want %d and %d", len(p.Nodes), len(p.Domains), nodes/2, nodes/6)
	}
	start := func(opts ...PullWatchOption) (w *PullWatch, msgs uint64) {
		msgs = received(func() {
			var err error
			if w, err = StartPullWatch(ctx, b, "pull-1", "docker.io/library/x:1", events.PullIfNotPresent, opts...); err != nil {
				t.Fatal(err)
			}
			w.Stop()
		})
		return w, msgs
	}
	fromPlan, n := start(WithNodeDomains(p.Domains))
	if n > 20 {
		t.Errorf("starting the watch with the plan's domains received %d messages: it read the registry again", n)
	}
	t.Logf("watch started with the plan's domains: %d messages received", n)
	fromRegistry, n := start()
	t.Logf("watch started reading the registry: %d messages received", n)
	if n < 2*nodes {
		t.Errorf("starting the watch without the plan's domains received %d messages, want the registry's %d at least", n, 2*nodes)
	}
	for _, node := range p.Nodes {
		want := events.PullSubject(node)
		if d := fromRegistry.domains[node]; d != "" {
			want = events.DomainSubject(d, want)
		}
		if got := fromPlan.pullSubject(node); got != want || got != fromRegistry.pullSubject(node) {
			t.Fatalf("%s: pull subject %q from the plan, %q from the registry, want %q", node, got, fromRegistry.pullSubject(node), want)
		}
	}
	if got := fromPlan.pullSubject("node-000"); got != events.DomainSubject("leaf-0", events.PullSubject("node-000")) {
		t.Fatalf("node-000's pull subject %q is not in its domain leaf-0", got)
	}

	// imagefleet pull --node: one entry, not the registry.
	for _, tc := range []struct{ node, want string }{{"node-003", "leaf-3"}, {"node-001", ""}, {"no-such-node", ""}} {
		var got string
		n := received(func() {
			if got, err = NodeDomain(ctx, b, tc.node); err != nil {
				t.Fatal(err)
			}
		})
		if got != tc.want {
			t.Errorf("NodeDomain(%s) = %q, want %q", tc.node, got, tc.want)
		}
		if n > 5 {
			t.Errorf("NodeDomain(%s) received %d messages: it read more than the node's entry", tc.node, n)
		}
	}
}
