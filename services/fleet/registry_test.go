package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func TestNodeStates(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	period := events.Duration{Duration: 10 * time.Second}
	hb := func(node string, ago time.Duration) events.NodeInfo {
		return events.NodeInfo{Node: node, Heartbeat: now.Add(-ago), Period: period}
	}
	cases := []struct {
		name      string
		info      events.NodeInfo
		alive     bool
		lostAfter time.Duration
		want      string
	}{
		{"fresh", hb("n1", 2*time.Second), true, 0, events.NodeReady},
		{"exactly three periods", hb("n1", 30*time.Second), true, 0, events.NodeReady},
		{"past three periods", hb("n1", 31*time.Second), true, 0, events.NodeLost},
		{"ttl expired though recent", hb("n1", time.Second), false, 0, events.NodeLost},
		{"explicit lost-after", hb("n1", 5*time.Second), true, 4 * time.Second, events.NodeLost},
		{"clock skew into the future", hb("n1", -time.Minute), true, 0, events.NodeReady},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := fleet.NodeStates([]events.NodeInfo{tc.info}, map[string]bool{tc.info.Node: tc.alive}, now, tc.lostAfter)
			if len(got) != 1 || got[0].State != tc.want {
				t.Fatalf("state = %+v, want %s", got, tc.want)
			}
			if got[0].Age.Duration < 0 {
				t.Fatalf("negative age %v", got[0].Age)
			}
		})
	}
}

func TestHeartbeatRegistryAndLostDetection(t *testing.T) {
	bustest.VerifyNoLeaks(t) // after the server and connection are closed: Run left nothing behind
	_, b := bustest.Start(t)
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	rt := critest.NewRuntime()
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	// The registry is opened before the first heartbeat creates its buckets: it reads them once they exist.
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	var stops []func()
	for _, n := range []struct{ name, zone string }{{"node-a.example", "a"}, {"node-b", "b"}} {
		hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: n.name, Labels: map[string]string{"zone": n.zone},
			Period: 10 * time.Second, Workers: []string{"heartbeat"}, Statfs: statfs, Clock: clock}, rt, b)
		if err != nil {
			t.Fatal(err)
		}
		stops = append(stops, bustest.RunService(t, hb))
	}
	// A node is listed from its full record, written first, and reads Lost until its heartbeat key follows:
	// the wait is for both Ready, and what a Ready node shows (its full record: labels, runtime, usage) is
	// checked on that same listing.
	var nodes []events.NodeStatus
	bustest.WaitFor(t, "both nodes Ready", func() bool {
		var err error
		nodes, err = reg.Nodes(t.Context())
		return err == nil && len(nodes) == 2 && nodes[0].State == events.NodeReady && nodes[1].State == events.NodeReady
	})
	if nodes[0].Node != "node-a.example" || nodes[0].Labels["zone"] != "a" ||
		nodes[0].RuntimeName != "fake" || nodes[0].ImageFs.CapacityBytes != 100<<30 || nodes[0].ImageFs.Mountpoint != "/fake/images" {
		t.Fatalf("node a: %+v", nodes[0])
	}
	// Selection by label, Ready only.
	sel, _ := fleet.ParseSelector("zone in (a)")
	chosen, skipped := fleet.SelectNodes(nodes, sel, false)
	if !slices.Equal(chosen, []string{"node-a.example"}) || len(skipped) != 0 {
		t.Fatalf("chosen %v skipped %v", chosen, skipped)
	}
	for _, stop := range stops {
		stop()
	}
	// Time passes without heartbeats: a reader 31 s later shows both nodes as lost, not gone.
	later := func() time.Time { return now.Add(31 * time.Second) }
	reg, _ = fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: later})
	nodes, err = reg.Nodes(t.Context())
	if err != nil || len(nodes) != 2 {
		t.Fatalf("nodes after silence: %v %+v", err, nodes)
	}
	for _, n := range nodes {
		if n.State != events.NodeLost || n.Age.Duration != 31*time.Second {
			t.Errorf("%s: state %s age %v", n.Node, n.State, n.Age)
		}
	}
	chosen, skipped = fleet.SelectNodes(nodes, sel, false)
	if len(chosen) != 0 || len(skipped) != 1 || !strings.Contains(skipped[0].Error, "node is Lost (last heartbeat 31s ago)") {
		t.Fatalf("chosen %v skipped %+v", chosen, skipped)
	}
	chosen, _ = fleet.SelectNodes(nodes, sel, true)
	if !slices.Equal(chosen, []string{"node-a.example"}) {
		t.Fatalf("include lost: %v", chosen)
	}
	// Forget drops a node for good.
	if err := reg.Forget(t.Context(), "node-b"); err != nil {
		t.Fatal(err)
	}
	if nodes, _ := reg.Nodes(t.Context()); len(nodes) != 1 {
		t.Fatalf("after forget: %+v", nodes)
	}
}

func TestRegistryEmptyWithoutBuckets(t *testing.T) {
	_, b := bustest.Start(t)
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := reg.Nodes(t.Context())
	if err != nil || len(nodes) != 0 {
		t.Fatalf("nodes = %v, %v", nodes, err)
	}
}

func TestHeartbeatConfigValidation(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	cases := []struct {
		name    string
		cfg     fleet.HeartbeatConfig
		wantErr string
	}{
		{"no node", fleet.HeartbeatConfig{}, "node name is empty"},
		{"negative period", fleet.HeartbeatConfig{Node: "n1", Period: -time.Second}, "heartbeat period -1s must not be negative"},
		{"ttl under period", fleet.HeartbeatConfig{Node: "n1", Period: 10 * time.Second, TTL: time.Second}, "heartbeat ttl 1s must be at least the period 10s"},
		{"bad label", fleet.HeartbeatConfig{Node: "n1", Labels: map[string]string{"bad key": "v"}}, `label key "bad key"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := fleet.NewHeartbeat(tc.cfg, rt, b); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want %q", err, tc.wantErr)
			}
		})
	}
}

func TestParseLabelsAndSelector(t *testing.T) {
	cases := []struct {
		name, in string
		want     map[string]string
		wantErr  string
	}{
		{"two", "zone=a, tier=edge", map[string]string{"zone": "a", "tier": "edge"}, ""},
		{"empty", "", map[string]string{}, ""},
		{"prefixed key", "topology.kubernetes.io/zone=eu-1", map[string]string{"topology.kubernetes.io/zone": "eu-1"}, ""},
		{"no value", "zone", nil, `label "zone" is not key=value`},
		{"duplicate", "a=1,a=2", nil, `label "a" given twice`},
		{"bad value", "a=b c", nil, `label value "b c" of a`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := fleet.ParseLabels(tc.in)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || len(got) != len(tc.want) {
				t.Fatalf("got %v, %v", got, err)
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Fatalf("got %v", got)
				}
			}
		})
	}
	sels := []struct {
		sel    string
		labels map[string]string
		match  bool
	}{
		{"", map[string]string{"a": "1"}, true},
		{"zone=a", map[string]string{"zone": "a"}, true},
		{"zone=a", map[string]string{"zone": "b"}, false},
		{"zone!=a", map[string]string{}, true},
		{"zone in (a,b),tier", map[string]string{"zone": "b", "tier": "x"}, true},
		{"!gpu", map[string]string{"gpu": "1"}, false},
	}
	for _, s := range sels {
		sel, err := fleet.ParseSelector(s.sel)
		if err != nil {
			t.Fatalf("%q: %v", s.sel, err)
		}
		nodes := []events.NodeStatus{{NodeInfo: events.NodeInfo{Node: "n1", Labels: s.labels}, State: events.NodeReady}}
		chosen, _ := fleet.SelectNodes(nodes, sel, false)
		if (len(chosen) == 1) != s.match {
			t.Errorf("selector %q on %v: chosen %v, want match %v", s.sel, s.labels, chosen, s.match)
		}
	}
	if _, err := fleet.ParseSelector("zone=(a"); err == nil {
		t.Error("bad selector parsed")
	}
}

// TestRegistryListsEachNodeOnceWhileRecordsAreRewritten: the buckets stream by while nodes rewrite their
// records; a record rewritten meanwhile is delivered again, and the registry still lists every node once
// (a rollout refuses a plan that names a node twice), with its newer record.
func TestRegistryListsEachNodeOnceWhileRecordsAreRewritten(t *testing.T) {
	_, b := bustest.Start(t)
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	seen, err := b.KVExisting(t.Context(), events.NodesSeenBucket)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b.KVExisting(t.Context(), events.NodesBucket)
	if err != nil {
		t.Fatal(err)
	}
	const n = 300
	started := time.Now().UTC()
	write := func(ctx context.Context, i int) error {
		node := fmt.Sprintf("node-%03d", i)
		info := events.NodeInfo{Node: node, Started: started, Heartbeat: time.Now().UTC(), Period: events.Duration{Duration: 10 * time.Second},
			Labels: map[string]string{"pad": strings.Repeat("x", 200)}}
		raw, _ := json.Marshal(info)
		if _, err := seen.Put(ctx, events.NodeToken(node), raw); err != nil {
			return err
		}
		thin, _ := json.Marshal(events.NodeAlive{Node: node, Heartbeat: info.Heartbeat, Period: info.Period})
		_, err := alive.Put(ctx, events.NodeToken(node), thin)
		return err
	}
	for i := range n {
		if err := write(t.Context(), i); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { // every node rewritten, over and over, while the registry lists
		defer close(done)
		for i := 0; ctx.Err() == nil; i = (i + 1) % n {
			if err := write(ctx, i); err != nil && ctx.Err() == nil {
				t.Errorf("rewrite: %v", err)
				return
			}
		}
	}()
	defer func() { cancel(); <-done }()
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for round := range 30 {
		for _, limit := range []int{0, 50} {
			var names []string
			cont := ""
			for {
				page, err := reg.List(t.Context(), fleet.NodeQuery{Limit: limit, Continue: cont})
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range page.Nodes {
					names = append(names, s.Node)
				}
				if cont = page.Continue; cont == "" {
					break
				}
			}
			uniq := slices.Compact(slices.Sorted(slices.Values(names)))
			if len(names) != n || len(uniq) != n {
				var missing []string
				for i := range n {
					if node := fmt.Sprintf("node-%03d", i); !slices.Contains(uniq, node) {
						missing = append(missing, node)
					}
				}
				t.Fatalf("round %d, limit %d: listed %d nodes, %d of them distinct; want %d once each (missing %v)", round, limit, len(names), len(uniq), n, missing)
			}
		}
	}
}

// TestRegistryListsNewNodesWithTheirRecords: nodes send their first heartbeat while the registry lists; a
// node listed Ready (its heartbeat key found) is listed with its full record, which it wrote first, however
// the two buckets' streams interleave with its writes.
func TestRegistryListsNewNodesWithTheirRecords(t *testing.T) {
	_, b := bustest.Start(t)
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{})
	if err != nil {
		t.Fatal(err)
	}
	const n = 80
	rt := critest.NewRuntime()
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	beats := make([]*fleet.Heartbeat, n)
	for i := range n {
		node := fmt.Sprintf("node-%03d", i)
		if beats[i], err = fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: node, Labels: map[string]string{"node": node},
			Statfs: statfs}, rt, b); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { // each node's first heartbeat, one after another, while the registry lists
		defer close(done)
		for _, hb := range beats {
			if _, err := hb.Beat(ctx); err != nil {
				if ctx.Err() == nil {
					t.Errorf("beat: %v", err)
				}
				return
			}
		}
	}()
	defer func() { cancel(); <-done }()
	for listing := 0; ; listing++ {
		select {
		case <-done:
			if nodes, err := reg.Nodes(t.Context()); err != nil || len(nodes) != n {
				t.Fatalf("after every first heartbeat: %d nodes, %v; want %d", len(nodes), err, n)
			}
			t.Logf("%d listings while the nodes registered", listing)
			return
		default:
		}
		nodes, err := reg.Nodes(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, nd := range nodes {
			if nd.State == events.NodeReady && nd.Labels["node"] != nd.Node {
				t.Fatalf("listing %d: %s is Ready without its full record: %+v", listing, nd.Node, nd)
			}
		}
	}
}
