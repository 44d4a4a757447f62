package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/fleettest"
)

// BenchmarkFleetCLI runs the built `imagefleet fleet gc` binary, as an operator would, against 1,000
// hollow nodes (hollow CRI runtimes with the stand-in GC responder, registered through real heartbeats)
// on an embedded nats-server, and reports the orchestrator process's own peak RSS, the wall time of the
// command (registry listing, selection, ten slow-start batches, recording) and its exit.
func BenchmarkFleetCLI(b *testing.B) {
	bin := imagefleetBinary(b)
	for _, dry := range []bool{true, false} {
		b.Run(fmt.Sprintf("nodes=1000/dryrun=%v", dry), func(b *testing.B) {
			srv := bustest.Server(b)
			agents := bustest.Connect(b, srv)
			hf := fleettest.StartHollowFleet(b, agents, 1000, 8)
			ctx := context.Background()
			beat := func() {
				for i, c := range hf.Clients {
					hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: hf.Nodes[i].Name, Labels: fleettest.Labels(i), Period: time.Minute,
						Statfs: func(string) (int64, int64, error) { return 100 << 30, 50 << 30, nil }}, c, agents)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := hb.Beat(ctx); err != nil {
						b.Fatal(err)
					}
				}
			}
			beat()
			var maxRSS int64
			var wall time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				if !dry && i > 0 {
					if err := hf.Refill(); err != nil {
						b.Fatal(err)
					}
				}
				args := []string{"fleet", "gc", "--all-unused", "--nats", srv.ClientURL(), "--node-timeout", "30s", "-o", "json"}
				if dry {
					args = append(args, "--dry-run")
				}
				if p := os.Getenv("FLEET_BENCH_MEMPROFILE"); p != "" {
					args = append(args, "--mem-profile", p)
				}
				// The command runs under /usr/bin/time: the rusage of a child the test starts directly would report
				// this test process's peak (Linux keeps the old memory's high-water mark across the exec of a
				// vforked child), not the orchestrator's.
				rssFile := filepath.Join(b.TempDir(), "rss")
				cmd := exec.Command("/usr/bin/time", append([]string{"-f", "%M", "-o", rssFile, bin}, args...)...)
				var errb strings.Builder
				cmd.Stderr = &errb
				b.StartTimer()
				began := time.Now()
				out, err := cmd.Output()
				wall += time.Since(began)
				b.StopTimer()
				if err != nil {
					b.Fatalf("fleet gc: %v\n%s", err, errb.String())
				}
				var res events.RolloutResult
				if err := json.Unmarshal(out, &res); err != nil {
					b.Fatal(err)
				}
				if res.Succeeded != 1000 || len(res.Batches) != 10 {
					b.Fatalf("rollout: %d succeeded, batches %v", res.Succeeded, res.Batches)
				}
				raw, err := os.ReadFile(rssFile)
				if err != nil {
					b.Fatal(err)
				}
				kb, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
				if err != nil {
					b.Fatalf("maxrss %q: %v", raw, err)
				}
				maxRSS = max(maxRSS, kb)
				b.StartTimer()
			}
			b.StopTimer()
			b.ReportMetric(wall.Seconds()/float64(b.N), "s/rollout")
			b.ReportMetric(float64(maxRSS)/1024, "orchestrator-maxrss-MiB")
		})
	}
}
