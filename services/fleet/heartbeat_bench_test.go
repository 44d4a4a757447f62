package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
)

// BenchmarkHeartbeat measures what 10,000 nodes' heartbeats cost one nats-server, per heartbeat period: KV
// puts and payload bytes, and the wall time one period's heartbeats take when 64 at a time are in flight
// (the bucket's capacity: far under the period means one bucket takes the fleet). Each iteration runs, on
// one server and in this order:
//
//   - mode=previous: the previous release's heartbeat, the full record into both buckets (the baseline);
//   - mode=thin-steady: this release's heartbeat in steady state, the thin record every period and the full
//     one every defaultFullEvery-th (the nodes' full writes staggered, as nodes started at different times
//     spread them), averaged over 3 periods;
//   - mode=thin-restart: the period after every agent restarted at once (each writes its full record).
//
// Figures per period: puts/period, bytes/period (payload), and the derived puts/s and bytes/s at the default
// 10 s period; ratio-to-previous is thin-steady's puts over the baseline's.
func BenchmarkHeartbeat(b *testing.B) {
	const nodes, inFlight, steadyPeriods = 10000, 64, 3
	srv := bustest.Server(b)
	conn := bustest.Connect(b, srv)
	ctx := context.Background()
	alive, seen, err := heartbeatBuckets(ctx, conn, time.Duration(defaultLostAfterPeriods)*DefaultHeartbeatPeriod, 1)
	if err != nil {
		b.Fatal(err)
	}
	rt := critest.NewRuntime()
	rt.SetFsUsed(20 << 30)
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	hbs := make([]*Heartbeat, nodes)
	for i := range hbs {
		h, err := NewHeartbeat(HeartbeatConfig{Node: fmt.Sprintf("hollow-%d", i), AgentVersion: "v0.9.0",
			Labels:  map[string]string{"topology.kubernetes.io/zone": fmt.Sprintf("zone-%d", i%16), "node.kubernetes.io/instance-type": "m6i.2xlarge"},
			Workers: []string{"detector", "cache", "gc", "puller", "podindex", "heartbeat"}, Statfs: statfs}, rt, conn)
		if err != nil {
			b.Fatal(err)
		}
		hbs[i] = h
	}
	// period runs one heartbeat of every node, inFlight at a time, and returns the puts and bytes it sent.
	period := func(beat func(h *Heartbeat) error) (puts, bytes uint64, took time.Duration) {
		before := conn.Stats()
		began := time.Now()
		work := make(chan *Heartbeat)
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		for range inFlight {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for h := range work {
					if err := beat(h); err != nil {
						mu.Lock()
						firstErr = err
						mu.Unlock()
					}
				}
			}()
		}
		for _, h := range hbs {
			work <- h
		}
		close(work)
		wg.Wait()
		if firstErr != nil {
			b.Fatal(firstErr)
		}
		after := conn.Stats()
		return after.OutMsgs - before.OutMsgs, after.OutBytes - before.OutBytes, time.Since(began)
	}
	previous := func(h *Heartbeat) error {
		raw, err := json.Marshal(h.Info(ctx))
		if err != nil {
			return err
		}
		key := events.NodeToken(h.cfg.Node)
		if _, err := seen.Put(ctx, key, raw); err != nil {
			return err
		}
		_, err = alive.Put(ctx, key, raw)
		return err
	}
	thin := func(h *Heartbeat) error { _, err := h.beat(ctx, alive, seen); return err }
	type figures struct {
		puts, bytes uint64
		took        time.Duration
	}
	var prev, steady, restart figures
	for i := 0; i < b.N; i++ {
		p, by, took := period(previous)
		prev = figures{prev.puts + p, prev.bytes + by, prev.took + took}
		for _, h := range hbs {
			h.lastFull = events.NodeInfo{}
		}
		p, by, took = period(thin)
		restart = figures{restart.puts + p, restart.bytes + by, restart.took + took}
		for j, h := range hbs { // stagger: nodes started at different times
			h.sinceFull = j % h.cfg.FullEvery
		}
		for range steadyPeriods {
			p, by, took = period(thin)
			steady = figures{steady.puts + p, steady.bytes + by, steady.took + took}
		}
	}
	n := float64(b.N)
	perSecond := float64(DefaultHeartbeatPeriod / time.Second)
	report := func(name string, f figures, periods float64) {
		b.ReportMetric(float64(f.puts)/n/periods, name+"-puts/period")
		b.ReportMetric(float64(f.puts)/n/periods/perSecond, name+"-puts/s@10s")
		b.ReportMetric(float64(f.bytes)/n/periods/perSecond/1024, name+"-KiB/s@10s")
		b.ReportMetric(f.took.Seconds()/n/periods, name+"-s/period")
	}
	report("previous", prev, 1)
	report("steady", steady, steadyPeriods)
	report("restart", restart, 1)
	b.ReportMetric(float64(steady.puts)/steadyPeriods/float64(prev.puts), "ratio-to-previous")
}

// BenchmarkRegistryList reads a registry of 10,000 nodes (full records in the last-seen bucket, thin ones in
// the TTL bucket, written with direct KV puts) six ways, in one run: the previous release's read (both
// buckets listed whole into memory, then decoded: the baseline), this release's List of every node, a page of
// 100, a page of 100 of a selector matching 1/16 of the nodes, and a rollout's plan for that selector, first
// as it was (every node listed, then selectNodes: plan-whole), then Plan (the selector applied as the
// registry streams). Figures: ms per read, heap allocated per read (MiB), each one's ratio to the baseline's
// time, and Plan's allocation over plan-whole's.
func BenchmarkRegistryList(b *testing.B) {
	const nodes = 10000
	srv := bustest.Server(b)
	conn := bustest.Connect(b, srv)
	ctx := context.Background()
	alive, seen, err := heartbeatBuckets(ctx, conn, time.Hour, 1)
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now().UTC()
	fulls, thins := map[string][]byte{}, map[string][]byte{}
	for i := range nodes {
		info := events.NodeInfo{Node: fmt.Sprintf("hollow-%d", i), AgentVersion: "v0.9.0", RuntimeName: "containerd", RuntimeVersion: "2.1.0",
			Labels:  map[string]string{"topology.kubernetes.io/zone": fmt.Sprintf("zone-%d", i%16), "node.kubernetes.io/instance-type": "m6i.2xlarge"},
			Workers: []string{"detector", "cache", "gc", "puller", "podindex", "heartbeat"}, Started: now, Heartbeat: now,
			Period: events.Duration{Duration: DefaultHeartbeatPeriod}, ImageFs: events.ImageFsUsage{Mountpoint: "/var/lib/containerd",
				UsedBytes: 20 << 30, CapacityBytes: 100 << 30, AvailableBytes: 60 << 30}}
		full, _ := json.Marshal(info)
		thin, _ := json.Marshal(events.NodeAlive{Node: info.Node, Heartbeat: now, Period: info.Period})
		fulls[events.NodeToken(info.Node)], thins[events.NodeToken(info.Node)] = full, thin
		if len(fulls) == 1000 || i == nodes-1 {
			if err := seen.Batch(ctx, fulls, nil); err != nil {
				b.Fatal(err)
			}
			if err := alive.Batch(ctx, thins, nil); err != nil {
				b.Fatal(err)
			}
			fulls, thins = map[string][]byte{}, map[string][]byte{}
		}
	}
	reg, err := OpenRegistry(ctx, conn, RegistryOptions{})
	if err != nil {
		b.Fatal(err)
	}
	sel, err := ParseSelector("topology.kubernetes.io/zone=zone-3")
	if err != nil {
		b.Fatal(err)
	}
	// previousRelease is the previous release's Registry.Nodes.
	previousRelease := func() int {
		seenEntries, err := seen.List(ctx, ">")
		if err != nil {
			b.Fatal(err)
		}
		aliveEntries, err := alive.List(ctx, ">")
		if err != nil {
			b.Fatal(err)
		}
		live := map[string]bool{}
		for _, e := range aliveEntries {
			live[events.NodeFromToken(e.Key)] = true
		}
		infos := make([]events.NodeInfo, 0, len(seenEntries))
		for _, e := range seenEntries {
			var n events.NodeInfo
			if json.Unmarshal(e.Value, &n) == nil && n.Node != "" {
				infos = append(infos, n)
			}
		}
		return len(NodeStates(infos, live, now, 0))
	}
	list := func(q NodeQuery, want int) func() int {
		return func() int {
			page, err := reg.List(ctx, q)
			if err != nil {
				b.Fatal(err)
			}
			if len(page.Nodes) != want {
				b.Fatalf("%d nodes, want %d", len(page.Nodes), want)
			}
			return len(page.Nodes)
		}
	}
	ways := []struct {
		name string
		read func() int
	}{
		{"previous", previousRelease},
		{"all", list(NodeQuery{}, nodes)},
		{"page100", list(NodeQuery{Limit: 100}, 100)},
		{"selector-page100", list(NodeQuery{Selector: sel, Limit: 100}, 100)},
		// A rollout's plan for the selector: the previous release's (every node listed, then selected) and
		// Plan's (the selector applied as the registry streams).
		{"plan-whole", func() int {
			nodes, err := reg.Nodes(ctx)
			if err != nil {
				b.Fatal(err)
			}
			chosen, _ := selectNodes(nodes, sel, false)
			return len(chosen)
		}},
		{"plan", func() int {
			p, err := Plan(ctx, conn, "topology.kubernetes.io/zone=zone-3", false, nil)
			if err != nil {
				b.Fatal(err)
			}
			if len(p.Nodes) != nodes/16 {
				b.Fatalf("planned %d nodes, want %d", len(p.Nodes), nodes/16)
			}
			return len(p.Nodes)
		}},
	}
	took := make([]time.Duration, len(ways))
	allocs := make([]uint64, len(ways))
	var ms runtime.MemStats
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for w, way := range ways {
			runtime.ReadMemStats(&ms)
			before := ms.TotalAlloc
			began := time.Now()
			if n := way.read(); n == 0 {
				b.Fatalf("%s: no nodes", way.name)
			}
			took[w] += time.Since(began)
			runtime.ReadMemStats(&ms)
			allocs[w] += ms.TotalAlloc - before
		}
	}
	for w, way := range ways {
		b.ReportMetric(float64(took[w].Milliseconds())/float64(b.N), way.name+"-ms")
		b.ReportMetric(float64(allocs[w])/float64(b.N)/(1<<20), way.name+"-alloc-MiB")
		if w > 0 {
			b.ReportMetric(took[w].Seconds()/took[0].Seconds(), way.name+"-ratio")
		}
	}
	b.ReportMetric(float64(allocs[len(ways)-1])/float64(allocs[len(ways)-2]), "plan-alloc-ratio-to-whole")
}
