package integration_test

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkHollowGCMessages lists the messages one node's fleet GC makes, by subject: `imagefleet hollow
// --nodes N` (gcMsgsNodes, the row nodes=N; 8 unused images each) against one standalone
// nats-server, and a monitor connection of the same account subscribed while `imagefleet fleet gc
// --all-unused` runs, first as a dry run, then for real. Every message the server routes on countedSubjects
// is counted once (requests, replies, JetStream API requests and their answers, KV writes, events, acks,
// deliveries to a KV listing's consumer), less the idle rate of each subject measured just before, and the
// count is divided by N. Metrics: all of them, the JetStream API requests but pull requests (js-api), and
// those on $KV.> and imagefleet.evt.> (kv-evt: KV writes, events, and records a KV listing delivers). With IMAGEFLEET_BASELINE_BINARY set to an earlier build, its agents are measured
// too (bin=baseline); the server and the fleet command are this build's in both, so what differs is the
// node's side.
func BenchmarkHollowGCMessages(b *testing.B) {
	bin := imagefleetBinary(b)
	const n = gcMsgsNodes
	for _, bb := range agentBinaries(b, bin) {
		b.Run(fmt.Sprintf("bin=%s/nodes=%d", bb.name, n), func(b *testing.B) {
			for range b.N {
				url, bc := startBus(b, bin)
				h := startHollow(b, bb.path, "hollow", url, n, "--images-per-node", "8")
				waitReady(b, bc, h, "hollow-", n, 5*time.Minute)
				var mu sync.Mutex
				counts := map[string]int{}
				ctx, cancel := context.WithCancel(b.Context())
				done := make(chan error, len(countedSubjects))
				for _, subj := range countedSubjects {
					go func() {
						done <- bc.Subscribe(ctx, subj, func(subject string, _ map[string][]string, _ []byte) {
							k := msgKind(subject)
							mu.Lock()
							counts[k]++
							mu.Unlock()
						})
					}()
				}
				take := func() map[string]int {
					mu.Lock()
					defer mu.Unlock()
					out := counts
					counts = map[string]int{}
					return out
				}
				time.Sleep(2 * time.Second) // the subscription is registered
				take()
				const idleWindow = 10 * time.Second
				time.Sleep(idleWindow)
				idle := take()
				for _, op := range []string{"gc-dryrun", "gc", "prepull"} {
					args := []string{"fleet", "gc", "--all-unused", "--nats", url, "-o", "json"}
					switch op {
					case "gc-dryrun":
						args = append(args, "--dry-run")
					case "prepull":
						args = []string{"fleet", "pull", "registry.local/bench/prepull:v1", "--nats", url, "-o", "json"}
					}
					take()
					began := time.Now()
					if out, err := cli(b.Context(), bin, args...); err != nil {
						b.Fatalf("%s: %v\n%s", op, err, out)
					}
					time.Sleep(2 * time.Second) // what the pass set off after its reply (record deletes)
					got, wall := take(), time.Since(began)
					perNode := func(c int, k string) float64 {
						return (float64(c) - float64(idle[k])*wall.Seconds()/idleWindow.Seconds()) / float64(n)
					}
					var kinds []string
					for k := range got {
						kinds = append(kinds, k)
					}
					slices.Sort(kinds)
					var all, api, kvEvt float64
					for _, k := range kinds {
						v := perNode(got[k], k)
						if v < 0.05 {
							continue
						}
						b.Logf("%s %-70s %6.2f per node", op, k, v)
						all += v
						if strings.HasPrefix(k, "$JS.API.") && !strings.HasPrefix(k, "$JS.API.CONSUMER.MSG.NEXT") {
							api += v
						}
						if strings.HasPrefix(k, "$KV.") || strings.HasPrefix(k, "imagefleet.evt.") {
							kvEvt += v
						}
					}
					b.ReportMetric(all, op+"-msgs/node")
					b.ReportMetric(api, op+"-js-api/node")
					b.ReportMetric(kvEvt, op+"-kv-evt/node")
				}
				cancel()
				for range countedSubjects {
					if err := <-done; err != nil {
						b.Error(err)
					}
				}
			}
		})
	}
}

// gcMsgsNodes is BenchmarkHollowGCMessages's fleet: the figures are per node, so a few nodes suffice.
const gcMsgsNodes = 10

// countedSubjects are what BenchmarkHollowGCMessages subscribes to: everything a GC pass sends but the
// queries (imagefleet.qry.>): a subscriber there would answer for a pod index that does not run (the
// hollow agents run none, so the GC's in-use query gets "no responders" from the server at once; one
// query per removal batch, not counted).
var countedSubjects = []string{"$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "_INBOX.>", "imagefleet.evt.>", "imagefleet.cmd.>", "imagefleet.fleet.>"}

var (
	hollowToken = regexp.MustCompile(`hollow-[0-9]+`)
	longToken   = regexp.MustCompile(`[A-Za-z0-9_-]{16,}`)
)

// msgKind names a subject without its node, ids and inbox tokens: imagefleet.evt.<node>.image.removed,
// $KV.imagefleet-records, $JS.API.CONSUMER.CREATE.KV_imagefleet-records, _INBOX.
func msgKind(subject string) string {
	switch {
	case strings.HasPrefix(subject, "_INBOX."):
		return "_INBOX.* (replies, deliveries)"
	case strings.HasPrefix(subject, "$KV."):
		rest := strings.TrimPrefix(subject, "$KV.")
		bucket, _, _ := strings.Cut(rest, ".")
		return "$KV." + bucket
	case strings.HasPrefix(subject, "$JS.ACK."):
		parts := strings.Split(subject, ".")
		if len(parts) > 4 {
			return "$JS.ACK." + parts[2] + "." + hollowToken.ReplaceAllString(parts[3], "<node>")
		}
	case strings.HasPrefix(subject, "$JS.API."):
		parts := strings.Split(strings.TrimPrefix(subject, "$JS.API."), ".")
		if len(parts) >= 3 && parts[0] == "CONSUMER" && parts[1] == "MSG" {
			return "$JS.API.CONSUMER.MSG.NEXT." + parts[3]
		}
		if len(parts) >= 3 {
			return "$JS.API." + parts[0] + "." + parts[1] + "." + parts[2]
		}
	}
	s := hollowToken.ReplaceAllString(subject, "<node>")
	return longToken.ReplaceAllString(s, "<id>")
}
