package integration_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/internal/testenv"
)

// BenchmarkHollowIdleAPI counts the JetStream API requests that idle agents make: `imagefleet hollow --nodes
// N` (idleNodes, the row nodes=N) against one standalone nats-server; once every node is Ready and a
// settle time has passed, a monitor connection of the same account subscribes to `$JS.API.>` and `$KV.>`
// for a window and counts what arrives, per node and minute, by request kind. Nothing else runs: no
// rollout, no inventory; what is counted is per-node housekeeping (the consumer watchdog's info requests,
// bucket lookups, pull requests) and the heartbeat's and GC lease's KV writes. docs/scale.md: at 10,000
// nodes the housekeeping saturated the cluster's JetStream API. With IMAGEFLEET_BASELINE_BINARY set to an
// earlier build, its agents are measured too (bin=baseline), each against a fresh server started with this
// build.
//
// Rows: bin=B/nodes=N/settle=S (idleWaits): settle=30s (then a 90 s window) by default; settle=5m (then a
// 5-minute window: the watchdog's backoff settled, the figure of docs/benchmarks.md) only when -bench
// names it: -bench 'HollowIdleAPI$///settle=5m$'.
func BenchmarkHollowIdleAPI(b *testing.B) {
	bin := imagefleetBinary(b)
	raiseNoFile(b)
	const n = idleNodes
	for _, bb := range agentBinaries(b, bin) {
		for _, w := range testenv.Rows(idleWaits) {
			benchHollowIdleAPI(b, bin, fmt.Sprintf("bin=%s/nodes=%d/%s", bb.name, n, w.Name), bb.path, n, w.Value.settle, w.Value.window)
		}
	}
}

// idleNodes is BenchmarkHollowIdleAPI's fleet: the figures are per node.
const idleNodes = 200

// idleWait is how long BenchmarkHollowIdleAPI waits once every node is Ready, then counts.
type idleWait struct{ settle, window time.Duration }

// idleWaits are BenchmarkHollowIdleAPI's waits, a row (settle=S) each.
var idleWaits = []testenv.Row[idleWait]{
	{Name: "settle=30s", Value: idleWait{30 * time.Second, 90 * time.Second}},
	{Name: "settle=5m", Value: idleWait{5 * time.Minute, 5 * time.Minute}, Explicit: true},
}

// benchHollowIdleAPI runs BenchmarkHollowIdleAPI's row name: n agents of agentBin, counted for window after
// settle.
func benchHollowIdleAPI(b *testing.B, bin, name, agentBin string, n int, settle, window time.Duration) {
	b.Run(name, func(b *testing.B) {
		for range b.N {
			url, bc := startBus(b, bin)
			h := startHollow(b, agentBin, "hollow", url, n)
			_, waited := waitReady(b, bc, h, "hollow-", n, 5*time.Minute)
			b.Logf("%d agents Ready in %s; settling %s, then counting for %s", n, waited.Round(time.Millisecond), settle, window)
			time.Sleep(settle)
			var mu sync.Mutex
			counts := map[string]int{}
			ctx, cancel := context.WithTimeout(b.Context(), window)
			var wg sync.WaitGroup
			for _, subj := range []string{"$JS.API.>", "$KV.>"} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					err := bc.Subscribe(ctx, subj, func(subject string, _ map[string][]string, _ []byte) {
						k := apiKind(subject)
						mu.Lock()
						counts[k]++
						mu.Unlock()
					})
					if err != nil {
						b.Error(err)
					}
				}()
			}
			began := time.Now()
			wg.Wait()
			elapsed := time.Since(began)
			cancel()
			select {
			case <-h.done:
				b.Fatalf("hollow exited during the count: %v\n%s", h.cmd.ProcessState, tail(h.log, 30))
			default:
			}
			perNodeMin := func(c int) float64 { return float64(c) / float64(n) / elapsed.Minutes() }
			mu.Lock()
			var kinds []string
			api, apiHousekeeping, kv := 0, 0, 0
			for k, c := range counts {
				kinds = append(kinds, k)
				switch {
				case strings.HasPrefix(k, "$KV"):
					kv += c
				case k == "CONSUMER.MSG.NEXT":
					api += c
				default:
					api += c
					apiHousekeeping += c
				}
			}
			slices.Sort(kinds)
			for _, k := range kinds {
				b.Logf("%-40s %6d  %7.3f per node per minute", k, counts[k], perNodeMin(counts[k]))
			}
			b.ReportMetric(perNodeMin(apiHousekeeping), "api-housekeeping/node/min")
			b.ReportMetric(perNodeMin(api), "api-all/node/min")
			b.ReportMetric(perNodeMin(counts["CONSUMER.INFO"]), "consumer-info/node/min")
			b.ReportMetric(perNodeMin(kv), "kv-writes/node/min")
			mu.Unlock()
		}
	})
}

// apiKind names a JetStream API request by its subject without the stream, consumer or key
// ($JS.API.CONSUMER.INFO.S.C: CONSUMER.INFO; $KV.bucket.key: $KV.bucket).
func apiKind(subject string) string {
	if rest, ok := strings.CutPrefix(subject, "$KV."); ok {
		bucket, _, _ := strings.Cut(rest, ".")
		return "$KV." + bucket
	}
	rest := strings.TrimPrefix(subject, "$JS.API.")
	parts := strings.Split(rest, ".")
	switch {
	case len(parts) >= 3 && parts[0] == "CONSUMER" && (parts[1] == "MSG" || parts[1] == "DURABLE" || parts[1] == "LEADER"):
		return strings.Join(parts[:3], ".")
	case len(parts) >= 2:
		return parts[0] + "." + parts[1]
	}
	return rest
}

// agentBinary is a build whose agents a benchmark measures: this one ("current") or, with
// IMAGEFLEET_BASELINE_BINARY set to an earlier build, that one too ("baseline"), in the same run.
type agentBinary struct{ name, path string }

// agentBinaries is this build, then the baseline build when IMAGEFLEET_BASELINE_BINARY names one.
func agentBinaries(tb testing.TB, bin string) []agentBinary {
	tb.Helper()
	bins := []agentBinary{{"current", bin}}
	if base := testenv.String(tb, "IMAGEFLEET_BASELINE_BINARY"); base != "" {
		bins = append(bins, agentBinary{"baseline", base})
	}
	return bins
}
