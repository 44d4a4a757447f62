package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/services/puller"
)

// BenchmarkR3PullConsumers: can a three-server cluster (three `imagefleet bus` processes from
// deploy/nats/cluster, as the scale harness starts them) hold one R3 pull consumer per node on the 16 R3
// pull partitions, made exactly as the puller makes it (puller.ConsumerConfig), 8 at a time? Per storage of
// the consumer (layout=file: nats-server's default, its state and Raft log in files; layout=memory: both in
// memory, bus.ConsumerConfig.MemoryStorage) it reports how many were made and how long it took, the servers'
// CPU and summed RSS, whether the cluster stayed healthy (a meta leader on every server's /jsz, every
// partition's stream info answering within 10 s) at every 500 consumers (it stops making them at the first
// check that fails), and then, when healthy, the servers' CPU over an idle window with every consumer made
// (pullConsIdle), reported per minute; the baseline is the same servers' CPU over the same window before
// any node consumer is made (the streams only), and idle-ratio the one over the other. Each layout starts
// fresh servers.
//
// Rows: layout=L/nodes=N (pullConsNodes). 1,000 nodes (past the server's default of 1,000 consumers per
// stream it would be one stream) in both layouts run by default; the larger counts only when -bench names
// them:
//
//	go test -run '^$' -bench 'R3PullConsumers$/layout=memory/nodes=10000$' -benchtime 1x -timeout 60m -v ./integration/
//
// It makes them for pullConsBudget at most. A layout that cannot make them all is a result, not a
// failure: it is logged and reported (made, healthy) and the benchmark goes on to the next.
func BenchmarkR3PullConsumers(b *testing.B) {
	bin := imagefleetBinary(b)
	for _, layout := range []string{"file", "memory"} {
		for _, nr := range testenv.Rows(pullConsNodes) {
			n := nr.Value
			b.Run("layout="+layout+"/"+nr.Name, func(b *testing.B) {
				for range b.N {
					r := runR3PullConsumers(b, bin, layout, n, pullConsBudget, pullConsIdle)
					b.ReportMetric(float64(r.made), "made")
					b.ReportMetric(r.took.Seconds(), "s/all")
					if r.made > 0 {
						b.ReportMetric(r.took.Seconds()/float64(r.made)*1e3, "ms/consumer")
					}
					b.ReportMetric(r.cpu.Seconds(), "server-cpu-s")
					b.ReportMetric(float64(r.rss>>20), "server-rss-MB")
					perMin := time.Minute.Seconds() / pullConsIdle.Seconds()
					b.ReportMetric(r.idleCPU.Seconds()*perMin, "idle-server-cpu-s/min")
					b.ReportMetric(r.baseIdleCPU.Seconds()*perMin, "baseline-idle-server-cpu-s/min")
					if r.baseIdleCPU > 0 && r.idleCPU > 0 {
						b.ReportMetric(float64(r.idleCPU)/float64(r.baseIdleCPU), "idle-ratio")
					}
					healthy := 0.0
					if r.healthy {
						healthy = 1
					}
					b.ReportMetric(healthy, "healthy")
				}
			})
		}
	}
}

// pullConsNodes are BenchmarkR3PullConsumers's consumer counts, a row (nodes=N) each: 1,000 by default; the
// larger ones (10,000 take up to the budget per layout, and the cluster lost quorum past 3,500-7,000:
// docs/benchmarks.md) run only when -bench names them.
var pullConsNodes = testenv.IntRows("nodes", []int{1000}, []int{2000, 3000, 5000, 10000})

// BenchmarkR3PullConsumers makes the consumers for pullConsBudget at most, and measures the servers idle
// over pullConsIdle (reported per minute, so a longer window changes the noise, not the figure).
const pullConsBudget, pullConsIdle = 20 * time.Minute, 30 * time.Second

type r3PullResult struct {
	made          int
	took          time.Duration
	cpu, idleCPU  time.Duration
	baseIdleCPU   time.Duration // the same servers idle with the streams and no node consumer
	rss           int64
	healthy       bool
	firstFailures []string
}

func runR3PullConsumers(b *testing.B, bin, layout string, n int, budget, idle time.Duration) r3PullResult {
	b.Helper()
	if layout != "file" && layout != "memory" {
		b.Fatalf("layout %q: want file or memory", layout)
	}
	confs, urls := clusterConfigs(b)
	var servers []*proc
	var monitors []string
	httpRe := regexp.MustCompile(`(?m)^http: (\S+)`)
	for i, conf := range confs {
		raw, err := os.ReadFile(conf)
		if err != nil {
			b.Fatal(err)
		}
		m := httpRe.FindStringSubmatch(string(raw))
		if m == nil {
			b.Fatalf("%s: no http listen", conf)
		}
		monitors = append(monitors, "http://"+m[1])
		servers = append(servers, startProc(b, fmt.Sprintf("nats-%d", i+1), bin, "bus", "--config", conf))
	}
	defer func() {
		for _, s := range servers {
			s.stop(syscall.SIGKILL) // a server holding thousands of consumers takes long to stop cleanly
		}
	}()
	ctx := b.Context()
	bb, err := bus.Connect(ctx, strings.Join(urls, ","), bus.Options{Name: "pull-consumers-bench", Replicas: 3})
	if err != nil {
		b.Fatal(err)
	}
	defer bb.Close()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := bb.EnsureStreams(sctx, bus.StreamsConfig{Replicas: 3})
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("streams: %v", err)
		}
		time.Sleep(time.Second)
	}
	pids := func() []int {
		var out []int
		for _, s := range servers {
			out = append(out, s.cmd.Process.Pid)
		}
		return out
	}
	usage := func() (cpu time.Duration, rss int64) {
		for _, pid := range pids() {
			st, err := readProcStat(pid)
			if err != nil {
				b.Logf("server %d: %v", pid, err)
				continue
			}
			cpu += st.CPU
			rss += st.RSS
		}
		return cpu, rss
	}
	health := func() error {
		for _, m := range monitors {
			leader, err := metaLeader(ctx, m)
			if err != nil {
				return err
			}
			if leader == "" {
				return fmt.Errorf("%s: no meta leader", m)
			}
		}
		for p := range events.PullPartitions {
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := bb.Stream(sctx, events.PullPartitionStream(p))
			cancel()
			if err != nil {
				return err
			}
		}
		return nil
	}

	var res r3PullResult
	base0, _ := usage()
	time.Sleep(idle)
	base1, _ := usage()
	res.baseIdleCPU = base1 - base0
	b.Logf("%s: baseline: idle %v with the streams and no node consumer: servers %v CPU", layout, idle,
		res.baseIdleCPU.Round(10*time.Millisecond))
	cpu0, _ := usage()
	began := time.Now()
	stop := began.Add(budget)
	var (
		made, failed atomic.Int64
		mu           sync.Mutex
		wg           sync.WaitGroup
		giveUp       atomic.Bool
	)
	next := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				cc := puller.ConsumerConfig(puller.Config{Node: fmt.Sprintf("hollow-%d", i)})
				cc.MemoryStorage, cc.MemoryStorageWhenReplicated = layout == "memory", false
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				err := bb.EnsureConsumer(cctx, cc)
				cancel()
				if err != nil {
					mu.Lock()
					if len(res.firstFailures) < 5 {
						res.firstFailures = append(res.firstFailures, fmt.Sprintf("hollow-%d after %v: %v", i, time.Since(began).Round(time.Second), err))
					}
					mu.Unlock()
					if failed.Add(1) >= 16 {
						giveUp.Store(true)
					}
					continue
				}
				made.Add(1)
			}
		}()
	}
	res.healthy = true
	for i := range n {
		if giveUp.Load() || time.Now().After(stop) {
			break
		}
		if i > 0 && i%500 == 0 {
			cpu, rss := usage()
			herr := health()
			b.Logf("%s: %d made, %d failed after %v; servers %v CPU, %d MB RSS; health: %v", layout, made.Load(),
				failed.Load(), time.Since(began).Round(time.Second), (cpu - cpu0).Round(time.Second), rss>>20, errOr(herr))
			if herr != nil {
				res.healthy = false
				break // the cluster is the result: making more only loads a machine shared with others
			}
		}
		next <- i
	}
	close(next)
	wg.Wait()
	res.took = time.Since(began)
	res.made = int(made.Load())
	cpu1, rss := usage()
	res.cpu, res.rss = cpu1-cpu0, rss
	herr := health()
	if herr != nil {
		res.healthy = false
	}
	b.Logf("%s: %d of %d made, %d failed, in %v; servers %v CPU, %d MB RSS summed; health: %v", layout, res.made, n,
		failed.Load(), res.took.Round(time.Second), res.cpu.Round(time.Second), res.rss>>20, errOr(herr))
	for _, f := range res.firstFailures {
		b.Logf("%s: failure: %s", layout, f)
	}
	if !res.healthy {
		return res // no idle figure for a cluster that is not healthy
	}
	// Idle: every consumer made, nothing published.
	idle0, _ := usage()
	time.Sleep(idle)
	idle1, rss := usage()
	res.idleCPU = idle1 - idle0
	herr = health()
	if herr != nil {
		res.healthy = false
	}
	b.Logf("%s: idle %v with %d consumers: servers %v CPU, %d MB RSS summed; health: %v", layout, idle, res.made,
		res.idleCPU.Round(10*time.Millisecond), rss>>20, errOr(herr))
	for i, pid := range pids() {
		st, err := readProcStat(pid)
		if err == nil {
			b.Logf("%s: server nats-%d: %v CPU, RSS %d MB, peak %d MB", layout, i+1, st.CPU.Round(time.Second), st.RSS>>20, st.HWM>>20)
		}
	}
	return res
}

// metaLeader asks a server's monitoring endpoint for the JetStream meta group's leader ("" when it has none).
func metaLeader(ctx context.Context, monitor string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, monitor+"/jsz", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("jsz: %w", err)
	}
	defer resp.Body.Close()
	var jsz struct {
		Meta *struct {
			Leader string `json:"leader"`
		} `json:"meta_cluster"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
		return "", fmt.Errorf("jsz: %w", err)
	}
	if jsz.Meta == nil {
		return "", nil
	}
	return jsz.Meta.Leader, nil
}

func errOr(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}
