package puller

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
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
// (docs/benchmarks.md, Issue 15): three servers in one process on two cores cannot carry 30,000 consumer
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

// benchBus starts one embedded nats-server, or a cluster of three in this process, with the streams
// ensured (R3 on the cluster), and connects to it. stop removes the pull streams (a server holding
// thousands of file-store consumers takes tens of seconds to shut down) and stops everything.
func benchBus(b *testing.B, servers int) (*bus.Bus, func()) {
	b.Helper()
	dir := b.TempDir()
	var srvs []*bus.Server
	var urls string
	if servers == 1 {
		srv, err := bus.StartServer(bus.ServerConfig{Listen: "127.0.0.1:-1", StoreDir: dir})
		if err != nil {
			b.Fatal(err)
		}
		srvs, urls = append(srvs, srv), srv.ClientURL()
	} else {
		client := make([]int, servers)
		route := make([]int, servers)
		for i := range servers {
			client[i], route[i] = testport.Free(b), testport.Free(b)
		}
		routes := ""
		for i := range servers {
			routes += fmt.Sprintf("    nats-route://127.0.0.1:%d\n", route[i])
		}
		type started struct {
			srv *bus.Server
			err error
		}
		ch := make(chan started, servers)
		for i := range servers {
			conf := fmt.Sprintf("server_name: bench-%d\nlisten: 127.0.0.1:%d\njetstream { store_dir: %q }\n"+
				"cluster {\n  name: bench\n  listen: 127.0.0.1:%d\n  routes: [\n%s  ]\n}\n",
				i, client[i], filepath.Join(dir, fmt.Sprint(i)), route[i], routes)
			p := filepath.Join(dir, fmt.Sprintf("server-%d.conf", i))
			if err := os.WriteFile(p, []byte(conf), 0o600); err != nil {
				b.Fatal(err)
			}
			go func() {
				srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: p})
				ch <- started{srv, err}
			}()
			if urls != "" {
				urls += ","
			}
			urls += fmt.Sprintf("nats://127.0.0.1:%d", client[i])
		}
		for range servers {
			s := <-ch
			if s.err != nil {
				b.Fatal(s.err)
			}
			srvs = append(srvs, s.srv)
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
		for _, s := range srvs {
			s.Shutdown()
		}
	}
}
