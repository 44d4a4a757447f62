package fleet_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// revision returns key's revision in bucket (0: missing).
func revision(t *testing.T, b *bus.Bus, bucket, key string) uint64 {
	t.Helper()
	kv, err := b.KVExisting(t.Context(), bucket)
	if err != nil {
		t.Fatal(err)
	}
	_, rev, err := kv.Get(t.Context(), key)
	if err != nil {
		t.Fatalf("get %s/%s: %v", bucket, key, err)
	}
	return rev
}

// TestHeartbeatWritesFullRecordOnChangeOrEveryNth: every heartbeat puts the thin record into the TTL bucket;
// the full record goes into the last-seen bucket on the first heartbeat, every FullEvery-th, and when the
// usage moves by 1% of the capacity; the registry shows the latest heartbeat time either way.
func TestHeartbeatWritesFullRecordOnChangeOrEveryNth(t *testing.T) {
	_, b := bustest.Start(t)
	var now atomic.Int64
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now.Store(start.UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()).UTC() }
	rt := critest.NewRuntime()
	rt.SetFsUsed(10 << 30)
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: "n1.example", Period: 10 * time.Second, FullEvery: 3,
		Statfs: statfs, Clock: clock}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	key := events.NodeToken("n1.example")
	beat := func() {
		t.Helper()
		now.Add(int64(10 * time.Second))
		if _, err := hb.Beat(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	var seenRevs, aliveRevs []uint64
	record := func() {
		seenRevs = append(seenRevs, revision(t, b, events.NodesSeenBucket, key))
		aliveRevs = append(aliveRevs, revision(t, b, events.NodesBucket, key))
	}
	for range 4 { // beats 1..4: full on 1 and 4
		beat()
		record()
	}
	rt.SetFsUsed(10<<30 + 512<<20) // 0.5% of the capacity: not a change
	beat()
	record()
	rt.SetFsUsed(12 << 30) // 2%: a change
	beat()
	record()
	// Count distinct seen writes: a new revision means a put.
	wantSeen := []bool{true, false, false, true, false, true} // written at beat i?
	for i := range seenRevs {
		written := i == 0 || seenRevs[i] != seenRevs[i-1]
		if written != wantSeen[i] {
			t.Errorf("beat %d: full record written %v, want %v (seen revisions %v)", i+1, written, wantSeen[i], seenRevs)
		}
		if i > 0 && aliveRevs[i] == aliveRevs[i-1] {
			t.Errorf("beat %d: alive record not written (revisions %v)", i+1, aliveRevs)
		}
	}
	kv, _ := b.KVExisting(t.Context(), events.NodesBucket)
	raw, _, err := kv.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) > 120 {
		t.Errorf("alive record is %d bytes, want a thin one: %s", len(raw), raw)
	}
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := reg.Nodes(t.Context())
	if err != nil || len(nodes) != 1 {
		t.Fatalf("nodes: %v %+v", err, nodes)
	}
	if n := nodes[0]; n.State != events.NodeReady || !n.Heartbeat.Equal(clock()) || n.ImageFs.UsedBytes != 12<<30 ||
		n.RuntimeName != "fake" || n.Age.Duration != 0 {
		t.Fatalf("node: %+v", n)
	}
	// Two beats without a full write: the registry still shows the thin record's time.
	beat()
	beat()
	nodes, _ = reg.Nodes(t.Context())
	if n := nodes[0]; n.State != events.NodeReady || !n.Heartbeat.Equal(clock()) {
		t.Fatalf("after thin beats: %+v (now %v)", n, clock())
	}
}

// previousReleaseBeat is what an agent of the previous release writes every period: its full record into both
// buckets.
func previousReleaseBeat(t *testing.T, b *bus.Bus, info events.NodeInfo) {
	t.Helper()
	raw, err := json.Marshal(info)
	if err != nil {
		t.Fatal(err)
	}
	for _, bucket := range []string{events.NodesSeenBucket, events.NodesBucket} {
		kv, err := b.KVExisting(t.Context(), bucket)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Put(t.Context(), events.NodeToken(info.Node), raw); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRegistryDuringRollingUpgrade: agents of the previous release (full record in both buckets every period)
// and of this one (thin record every period) are both listed, Ready, with their labels, by the registry and
// by a selector; a previous-release agent that stops goes Lost like any other.
func TestRegistryDuringRollingUpgrade(t *testing.T) {
	_, b := bustest.Start(t)
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	var now atomic.Int64
	now.Store(start.UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()).UTC() }
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	rt := critest.NewRuntime()
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: "new-1", Labels: map[string]string{"zone": "a"},
		Period: 10 * time.Second, Statfs: statfs, Clock: clock, AgentVersion: "v2"}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	old := func(node, zone string) events.NodeInfo {
		return events.NodeInfo{Node: node, Labels: map[string]string{"zone": zone}, RuntimeName: "containerd",
			RuntimeVersion: "2.1.0", AgentVersion: "v1", Workers: []string{"heartbeat", "gc"}, Started: start,
			Heartbeat: clock(), Period: events.Duration{Duration: 10 * time.Second},
			ImageFs: events.ImageFsUsage{UsedBytes: 5 << 30, CapacityBytes: 50 << 30}}
	}
	// Five periods of a mixed fleet: the new agent writes its full record once, the old ones every time.
	for range 5 {
		now.Add(int64(10 * time.Second))
		if _, err := hb.Beat(t.Context()); err != nil {
			t.Fatal(err)
		}
		previousReleaseBeat(t, b, old("old-1", "a"))
		previousReleaseBeat(t, b, old("old-2", "b"))
	}
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := reg.Nodes(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, n := range nodes {
		names = append(names, fmt.Sprintf("%s/%s/%s/%s", n.Node, n.State, n.AgentVersion, n.Labels["zone"]))
		if !n.Heartbeat.Equal(clock()) {
			t.Errorf("%s: heartbeat %v, want %v", n.Node, n.Heartbeat, clock())
		}
	}
	if want := []string{"new-1/Ready/v2/a", "old-1/Ready/v1/a", "old-2/Ready/v1/b"}; !slices.Equal(names, want) {
		t.Fatalf("nodes %v, want %v", names, want)
	}
	sel, _ := fleet.ParseSelector("zone=a")
	page, err := reg.List(t.Context(), fleet.NodeQuery{Selector: sel})
	if err != nil || len(page.Nodes) != 2 || page.Nodes[0].Node != "new-1" || page.Nodes[1].Node != "old-1" || page.Total != 3 {
		t.Fatalf("zone=a: %v %+v", err, page)
	}
	// old-2 stops; the others go on for four more periods: old-2 is Lost, the rest Ready.
	for range 4 {
		now.Add(int64(10 * time.Second))
		if _, err := hb.Beat(t.Context()); err != nil {
			t.Fatal(err)
		}
		previousReleaseBeat(t, b, old("old-1", "a"))
	}
	nodes, _ = reg.Nodes(t.Context())
	names = names[:0]
	for _, n := range nodes {
		names = append(names, n.Node+"/"+n.State)
	}
	if want := []string{"new-1/Ready", "old-1/Ready", "old-2/Lost"}; !slices.Equal(names, want) {
		t.Fatalf("nodes %v, want %v", names, want)
	}
}

// TestRegistryPages: pages of a selector's nodes in name order, each continuing after the last, whatever
// order the buckets hold them in.
func TestRegistryPages(t *testing.T) {
	_, b := bustest.Start(t)
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, i := range []int{7, 3, 24, 0, 11, 19, 5, 16, 2, 9, 21, 13, 1, 23, 8, 4, 12, 18, 6, 22, 10, 15, 20, 14, 17} {
		zone := "a"
		if i%3 == 0 {
			zone = "b"
		}
		node := fmt.Sprintf("node-%02d", i)
		if zone == "a" {
			want = append(want, node)
		}
		previousReleaseBeat(t, b, events.NodeInfo{Node: node, Labels: map[string]string{"zone": zone}, Started: now,
			Heartbeat: now, Period: events.Duration{Duration: 10 * time.Second}})
	}
	slices.Sort(want)
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	sel, _ := fleet.ParseSelector("zone=a")
	var got []string
	q := fleet.NodeQuery{Selector: sel, Limit: 5}
	for pages := 0; ; pages++ {
		if pages > 10 {
			t.Fatal("paging does not end")
		}
		page, err := reg.List(t.Context(), q)
		if err != nil {
			t.Fatal(err)
		}
		if page.Total != 25 || len(page.Nodes) > 5 {
			t.Fatalf("page %d: total %d, %d nodes", pages, page.Total, len(page.Nodes))
		}
		for _, n := range page.Nodes {
			got = append(got, n.Node)
		}
		if page.Continue == "" {
			break
		}
		q.Continue = page.Continue
	}
	if !slices.Equal(got, want) {
		t.Fatalf("paged %v, want %v", got, want)
	}
	if _, err := reg.List(t.Context(), fleet.NodeQuery{Limit: -1}); err == nil {
		t.Fatal("negative limit accepted")
	}
}

// TestHeartbeatStuckWriteGivesWayToAFreshOne: while the heartbeat bucket's stream is gone, a beat's write
// retries; once the stream is back, the first heartbeat stored is a fresh one, not the one made when the
// writes began to fail (its time as old as the outage).
func TestHeartbeatStuckWriteGivesWayToAFreshOne(t *testing.T) {
	_, b := bustest.Start(t)
	const period = time.Second
	hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: "n1.example", Period: period, TTL: time.Minute,
		Statfs: func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }}, critest.NewRuntime(), b)
	if err != nil {
		t.Fatal(err)
	}
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	cfg := bus.KVConfig{Bucket: events.NodesBucket, TTL: time.Minute, Replicas: 1,
		Description: "imagefleet node heartbeats; a key expires when its node stops"}
	alive, err := b.KV(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	key := events.NodeToken("n1.example")
	stop := bustest.RunFunc(t, "heartbeat", hb.Run)
	defer stop()
	bustest.WaitFor(t, "the first heartbeat", func() bool {
		_, _, err := alive.Get(t.Context(), key)
		return err == nil
	})
	if err := b.DeleteStream(t.Context(), "KV_"+events.NodesBucket); err != nil {
		t.Fatal(err)
	}
	const outage = 6 * time.Second
	time.Sleep(outage)
	// Made anew keeping every write (the heartbeat's own bucket keeps the last), so the first one stored is
	// still there to read when later ones follow.
	cfg.History = 64
	if _, err = b.KV(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	// The first write the new stream stored, with the server's time of storing it.
	var got events.NodeAlive
	var storedAt time.Time
	bustest.WaitWithin(t, "a heartbeat after the outage", 10*time.Second, func() bool {
		found := false
		err := b.Read(t.Context(), "KV_"+events.NodesBucket, "", func(m bus.StreamMsg) error {
			found, storedAt = json.Unmarshal(m.Data, &got) == nil, m.Time
			return bus.StopReading
		}, bus.From(1))
		return err == nil && found
	})
	t.Logf("first heartbeat after the outage: made %s, stored %s", got.Heartbeat.Format(time.RFC3339Nano), storedAt.Format(time.RFC3339Nano))
	// A beat is made at most one period before its write is stored, give or take a loaded machine's delays;
	// the one made when the stream went would be about the outage old.
	if age := storedAt.Sub(got.Heartbeat); age > outage/2 {
		t.Errorf("first heartbeat stored after a %v outage was made %v before; want under %v (one period: %v)", outage, age.Round(time.Millisecond), outage/2, period)
	}
}
