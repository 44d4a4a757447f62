package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
)

// BenchmarkLeafRollout runs the same fleet GC (dry run) and fleet pre-pull from the hub over hollow agents
// with the real workers placed two ways: layout=hub, every agent connected to the hub; layout=leaves, half
// on each of two leaf domains (docs/scale.md's leaf layout, deploy/nats/leaf-*.conf, --js-domain hub).
// Reported per rollout: wall time of the command, the hub server's messages (in + out, every connection)
// per node, and the messages per node that crossed the leaf connections.
//
// Rows: layout=L/nodes=N (leafNodes). 100 nodes run by default; 200 and 1,000 only when -bench names them:
//
//	go test ./integration/ -run XXX -bench 'LeafRollout$//nodes=200$' -benchtime 3x
//
// -bench 'LeafRollout/layout=leaves' runs one layout.
func BenchmarkLeafRollout(b *testing.B) {
	bin := imagefleetBinary(b)
	for _, layout := range []string{"hub", "leaves"} {
		for _, nr := range testenv.Rows(leafNodes) {
			benchLeafRollout(b, bin, layout, nr.Name, nr.Value)
		}
	}
}

// leafNodes are BenchmarkLeafRollout's node counts (even: half on each leaf domain), a row (nodes=N) each.
var leafNodes = testenv.IntRows("nodes", []int{100}, []int{200, 1000})

// benchLeafRollout runs BenchmarkLeafRollout's row layout/nodesRow: nodes agents placed as layout says.
func benchLeafRollout(b *testing.B, bin, layout, nodesRow string, nodes int) {
	b.Run("layout="+layout+"/"+nodesRow, func(b *testing.B) {
		var domains []string
		if layout == "leaves" {
			domains = []string{"leaf-a", "leaf-b"}
		}
		l := startLeafLayout(b, domains...)
		hubURL := l.hub.ClientURL()
		var first *proc
		for i := range 2 {
			url, extra := hubURL, []string{}
			if layout == "leaves" {
				url, extra = l.leaves[domains[i]].ClientURL(), []string{"--js-domain", "hub"}
			}
			p := startHollow(b, bin, fmt.Sprintf("hollow-%d", i), url, nodes/2, append(extra,
				"--first", fmt.Sprint(i*nodes/2), "--last", fmt.Sprint(nodes), "--images-per-node", "4",
				"--heartbeat-period", "10s")...)
			if first == nil {
				first = p
			}
		}
		waitReady(b, l.b, first, "hollow-", nodes, 3*time.Minute)

		var gcWall, pullWall time.Duration
		var hubMsgs, linkMsgs int64
		measure := func(args ...string) time.Duration {
			b.Helper()
			in0, out0, err := l.hub.MsgCounts()
			if err != nil {
				b.Fatal(err)
			}
			link0 := l.leafTraffic(b)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			began := time.Now()
			out, err := cli(ctx, bin, append(args, "--nats", hubURL, "-o", "json")...)
			wall := time.Since(began)
			if err != nil {
				b.Fatal(err)
			}
			var res events.RolloutResult
			if err := json.Unmarshal(out, &res); err != nil {
				b.Fatalf("%v: %s", err, out)
			}
			if res.Succeeded != nodes || len(res.Failed) != 0 {
				b.Fatalf("%v: %d succeeded, failed %v", args, res.Succeeded, res.Failed)
			}
			in1, out1, err := l.hub.MsgCounts()
			if err != nil {
				b.Fatal(err)
			}
			link1 := l.leafTraffic(b)
			hubMsgs += in1 + out1 - in0 - out0
			linkMsgs += link1.InMsgs + link1.OutMsgs - link0.InMsgs - link0.OutMsgs
			return wall
		}
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			gcWall += measure("fleet", "gc", "--dry-run")
			pullWall += measure("fleet", "pull", fmt.Sprintf("registry.local/bench/app:v%d", i))
		}
		b.StopTimer()
		per := float64(b.N)
		b.ReportMetric(gcWall.Seconds()/per, "gc-s/op")
		b.ReportMetric(pullWall.Seconds()/per, "pull-s/op")
		b.ReportMetric(float64(hubMsgs)/per/2/float64(nodes), "hub-msgs/node/rollout")
		b.ReportMetric(float64(linkMsgs)/per/2/float64(nodes), "link-msgs/node/rollout")
	})
}
