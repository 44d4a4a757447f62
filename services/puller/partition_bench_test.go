package puller

import (
	"context"
	"fmt"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// BenchmarkPullConsumers: how long making every node's pull consumer takes, exactly as the puller makes it
// (ConsumerConfig), across the 16 partitions: on one embedded nats-server (R1) and on a 3-server cluster in
// this process (R3 streams, so each consumer is a Raft group on three servers). The baseline, measured in
// the same run on the same servers, is the old layout at its most: 1,000 consumers on the single legacy
// queue; ratio is the per-consumer time over the baseline's. Each iteration starts fresh servers.
//
//	go test ./services/puller/ -run XXX -bench PullConsumers -benchtime 1x
//
// Not here: 10,000 R3 consumers on the in-process cluster. On this project's 2-core machine that run made
// about 4,350 in 9.5 minutes, at 3.6 GB of memory, with consumers reporting no quorum and routes timing out
// (docs/runs/2026-11-pull-consumers.md): three servers in one process on two cores cannot carry 30,000 consumer
// Raft groups; a real cluster has a machine per server.
func BenchmarkPullConsumers(b *testing.B) {
	for _, c := range []struct{ servers, n int }{{1, 1200}, {1, 10000}, {3, 1200}} {
		servers, n := c.servers, c.n
		b.Run(fmt.Sprintf("servers=%d/consumers=%d", servers, n), func(b *testing.B) {
			var total, base time.Duration
			for range b.N {
				bb, stop := benchBus(b, servers)
				began := time.Now()
				made, err := makeConsumers(b.Context(), bb, 1000, func(node string) bus.ConsumerConfig { return oldAgentConsumer(b, node) })
				if err != nil || made != 1000 {
					b.Fatalf("baseline: %d made: %v", made, err)
				}
				base += time.Since(began)
				began = time.Now()
				made, err = makeConsumers(b.Context(), bb, n, func(node string) bus.ConsumerConfig { return pullerConsumer(b, node) })
				if err != nil || made != n {
					b.Fatalf("%d of %d made: %v", made, n, err)
				}
				total += time.Since(began)
				stop()
			}
			per := total.Seconds() / float64(b.N*n)
			basePer := base.Seconds() / float64(b.N*1000)
			b.ReportMetric(total.Seconds()/float64(b.N), "s/all")
			b.ReportMetric(per*1e6, "us/consumer")
			b.ReportMetric(basePer*1e6, "baseline-us/consumer")
			b.ReportMetric(per/basePer, "ratio")
		})
	}
}

// benchBus starts one embedded nats-server, or a cluster of three in this process (bustest.StartCluster),
// with the streams ensured (R3 on the cluster), and connects to it. stop removes the pull streams (a server
// holding thousands of file-store consumers takes tens of seconds to shut down) and stops everything.
func benchBus(b *testing.B, servers int) (*bus.Bus, func()) {
	b.Helper()
	var stopServers func()
	var urls string
	if servers == 1 {
		srv, err := bus.StartServer(bus.ServerConfig{Listen: "127.0.0.1:-1", StoreDir: b.TempDir()})
		if err != nil {
			b.Fatal(err)
		}
		urls, stopServers = srv.ClientURL(), srv.Shutdown
	} else {
		c := bustest.StartCluster(b, servers, bustest.ClusterName("bench"))
		urls = c.URLs()
		stopServers = func() {
			for i := range servers {
				c.Stop(i)
			}
		}
	}
	bb, err := bus.Connect(b.Context(), urls, bus.Options{Name: b.Name(), Replicas: servers})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(b.Context(), 2*time.Minute)
	defer cancel()
	if err := bb.EnsureStreams(ctx, bus.StreamsConfig{Replicas: servers}); err != nil {
		b.Fatal(err)
	}
	return bb, func() {
		for p := range events.PullPartitions {
			_ = bb.DeleteStream(context.Background(), events.PullPartitionStream(p))
		}
		_ = bb.DeleteStream(context.Background(), events.PullStream)
		bb.Close()
		stopServers()
	}
}

// BenchmarkPullConsumersCluster: what a node's pull consumer costs on a 3-server cluster in this process
// (R3 streams), for 1,000 nodes (and 10,000 where it fits): the time to make them all (8 at a time) and the
// memory the process (three servers and the client) holds once they are made, the Go heap in use and the
// resident set. Each case starts fresh servers.
//
//	go test ./services/puller/ -run XXX -bench PullConsumersCluster -benchtime 1x
//
// The layouts:
//
//   - r3-file: exactly as the puller makes them (ConsumerConfig) on the R3 partition streams: each is a Raft
//     group on three servers, its log in files.
//   - r3-memory: the same with the consumer's state and Raft log in memory (ConsumerConfig.MemoryStorage).
//   - r1-limits: R1 consumers (one server each, no Raft group), the same filters, on 16 R3 streams with
//     limits retention. Not a layout the puller can use: nats-server refuses a consumer whose replicas differ
//     from its work queue stream's (err_code 10134, logged at the start); the case measures what that rule
//     costs at 10,000 nodes.
//
// Not here: 10,000 R3 consumers. In-process on this project's 2-core machine they stall at about 4,800
// (memory) or 4,350 (files) with consumers reporting no quorum (docs/benchmarks.md); with the servers as
// separate processes, integration's BenchmarkR3PullConsumers, at 3,500-7,000.
func BenchmarkPullConsumersCluster(b *testing.B) {
	for _, c := range []struct {
		layout string
		n      int
	}{{"r3-file", 1000}, {"r3-memory", 1000}, {"r1-limits", 1000}, {"r1-limits", 10000}} {
		b.Run(fmt.Sprintf("%s/consumers=%d", c.layout, c.n), func(b *testing.B) {
			for range b.N {
				cl := bustest.StartCluster(b, 3, bustest.ClusterName("pull"))
				bb := connectCluster(b, cl, "bench")
				mk := func(node string) bus.ConsumerConfig {
					cc := pullerConsumer(b, node)
					cc.MemoryStorage, cc.MemoryStorageWhenReplicated = c.layout == "r3-memory", false
					return cc
				}
				if c.layout == "r1-limits" {
					cc := pullerConsumer(b, "refused")
					cc.Replicas = 1
					b.Logf("R1 consumer on an R3 partition stream: %v", bb.EnsureConsumer(b.Context(), cc))
					for p := range events.PullPartitions {
						if err := bb.EnsureStream(b.Context(), bus.StreamConfig{Name: limitsStream(p),
							Subjects: []string{limitsStream(p) + ".>"}, Replicas: 3}); err != nil {
							b.Fatal(err)
						}
					}
					mk = func(node string) bus.ConsumerConfig {
						cc := pullerConsumer(b, node)
						p := events.PullPartition(node)
						cc.Stream, cc.FilterSubjects, cc.Replicas = limitsStream(p), []string{limitsStream(p) + "." + node}, 1
						return cc
					}
				}
				heap0, rss0 := memNow()
				began := time.Now()
				made, err := makeConsumers(b.Context(), bb, c.n, mk)
				took := time.Since(began)
				heap1, rss1 := memNow()
				b.Logf("%d of %d made in %v; heap in use %d MB -> %d MB, RSS %d MB -> %d MB", made, c.n, took,
					heap0>>20, heap1>>20, rss0>>20, rss1>>20)
				if err != nil || made != c.n {
					b.Fatalf("%d of %d made: %v", made, c.n, err)
				}
				b.ReportMetric(took.Seconds(), "s/all")
				b.ReportMetric(float64(heap1>>20), "heap-MB")
				b.ReportMetric(float64(rss1>>20), "rss-MB")
				for p := range events.PullPartitions {
					_ = bb.DeleteStream(context.Background(), events.PullPartitionStream(p))
					_ = bb.DeleteStream(context.Background(), limitsStream(p))
				}
			}
		})
	}
}

func limitsStream(p int) string { return fmt.Sprintf("BENCH_PULL_LIMITS_%02d", p) }

// memNow is the Go heap in use (after a collection) and the resident set of this process, in bytes.
func memNow() (heap, rss uint64) {
	goruntime.GC()
	var ms goruntime.MemStats
	goruntime.ReadMemStats(&ms)
	status, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			rss = kb << 10
		}
	}
	return ms.HeapInuse, rss
}
