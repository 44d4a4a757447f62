package integration_test

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// The scale benchmarks run `imagefleet hollow` (real node workers over hollow CRI runtimes) on a
// three-server NATS cluster with R3 streams, and the built `imagefleet fleet` commands against it, as an
// operator would. They are long (a fleet per row): the fleet sizes (nodes=N, fleetSizes) and the streams'
// replicas (streams=..., streamRows) are rows, and `go tool task bench` (-bench .) runs the default ones,
// 1,000 nodes on R3 streams; the others run only when -bench names them (testenv.Row):
//
//	go test -run '^$' -bench 'HollowFleet$/nodes=10000$/streams=r3-pull-r1$' -benchtime 1x -timeout 2h ./integration/
//
// docs/testing.md, "Picking a sweep row with -bench".
//
// 10,000 agents need about 10 file descriptors each in the hollow process (a socket per node and its
// client) and the cluster's connections: the benchmarks raise RLIMIT_NOFILE to the hard limit.

// fleetSizes are the fleet sizes of the scale benchmarks (BenchmarkHollowFleet, BenchmarkInventoryCatchUp,
// BenchmarkControllerObjects), a row (nodes=N) each. 1,000 is the default row; the larger ones run only
// when -bench names them: -bench 'HollowFleet$/nodes=10000$' (most of an hour). 3,000 and 5,000 are the
// sizes between: a 2-core machine that cannot hold 10,000 agents at rest still measures them.
var fleetSizes = testenv.IntRows("nodes", []int{1000}, []int{1500, 2000, 3000, 5000, 10000})

// clusterStreams is the stream replicas of a scale benchmark's three-server cluster.
type clusterStreams struct {
	replicas int // every stream's and bucket's (bus init --stream-replicas)
	pull     int // the 16 pull partitions' and so the node consumers' (bus init --pull-replicas); 0: replicas
}

// streamRows are the scale benchmarks' clusters, a row (streams=...) each: streams=r3, every stream and
// bucket R3, is the default; streams=r3-pull-r1 (the pull partitions R1, every other stream R3) and
// streams=r1 (every stream R1), for a fleet whose R3 node consumers do not fit the machine (10,000 did
// not on this 2-core machine: docs/benchmarks.md), run only when -bench names them.
var streamRows = []testenv.Row[clusterStreams]{
	{Name: "streams=r3", Value: clusterStreams{replicas: 3}},
	{Name: "streams=r3-pull-r1", Value: clusterStreams{replicas: 3, pull: 1}, Explicit: true},
	{Name: "streams=r1", Value: clusterStreams{replicas: 1}, Explicit: true},
}

// raiseNoFile raises this process's open-file limit (inherited by the servers and hollow processes it
// starts) to 1<<20 when running as root and allowed to, else to the hard limit.
func raiseNoFile(b *testing.B) uint64 {
	b.Helper()
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		b.Fatal(err)
	}
	if os.Geteuid() == 0 && rl.Max < 1<<20 {
		// Root may raise the hard limit too, unless a container took CAP_SYS_RESOURCE: then the hard limit
		// it has is what there is.
		up := syscall.Rlimit{Cur: 1 << 20, Max: 1 << 20}
		if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &up) == nil {
			return up.Cur
		}
	}
	rl.Cur = rl.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		b.Fatalf("raise RLIMIT_NOFILE to %d: %v", rl.Max, err)
	}
	return rl.Cur
}

// monitorURLs returns the servers' monitoring endpoints (http: in the rendered configs).
func (c *natsCluster) monitorURLs(b testing.TB) []string {
	b.Helper()
	re := regexp.MustCompile(`(?m)^http:\s*(\S+)`)
	var out []string
	for _, s := range c.servers {
		conf := s.cmd.Args[len(s.cmd.Args)-1]
		raw, err := os.ReadFile(conf)
		if err != nil {
			b.Fatal(err)
		}
		m := re.FindSubmatch(raw)
		if m == nil {
			b.Fatalf("%s has no http: line", conf)
		}
		out = append(out, "http://"+string(m[1]))
	}
	return out
}

// serverMsgs sums in_msgs over the servers (/varz): every message a client or a route handed a server.
func serverMsgs(ctx context.Context, urls []string) (int64, error) {
	return sumMonitor(ctx, urls, "/varz", func(v monitorCounts) int64 { return v.InMsgs })
}

// serverJSAPI sums the JetStream API requests the servers handled (/jsz api.total): stream, consumer and
// message requests, and the meta leader's share of them.
func serverJSAPI(ctx context.Context, urls []string) (int64, error) {
	return sumMonitor(ctx, urls, "/jsz", func(v monitorCounts) int64 { return v.API.Total })
}

// monitorCounts is what the scale benchmarks read of /varz and /jsz.
type monitorCounts struct {
	InMsgs int64 `json:"in_msgs"`
	API    struct {
		Total int64 `json:"total"`
	} `json:"api"`
}

// sumMonitor sums field of one monitoring endpoint over the servers.
func sumMonitor(ctx context.Context, urls []string, path string, field func(monitorCounts) int64) (int64, error) {
	var sum int64
	for _, u := range urls {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u+path, nil)
		if err != nil {
			return 0, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		var v monitorCounts
		err = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		if err != nil {
			return 0, fmt.Errorf("%s%s: %w", u, path, err)
		}
		sum += field(v)
	}
	return sum, nil
}

// timedRun runs the binary under /usr/bin/time and returns its stdout, wall time, peak RSS and CPU time.
// (The rusage of a child the test starts directly would report this test process's peak: Linux keeps the
// old memory's high-water mark across the exec of a vforked child.)
func timedRun(b testing.TB, bin string, args ...string) (out []byte, wall time.Duration, maxRSS int64, cpu time.Duration) {
	b.Helper()
	return timedRunExit(b, bin, nil, args...)
}

// timedRunExit is timedRun taking also the exit codes in ok as a run to measure (a rollout's 2: nodes failed).
func timedRunExit(b testing.TB, bin string, ok []int, args ...string) (out []byte, wall time.Duration, maxRSS int64, cpu time.Duration) {
	b.Helper()
	f := filepath.Join(b.TempDir(), "time")
	cmd := exec.Command("/usr/bin/time", append([]string{"-f", "%M %U %S", "-o", f, bin}, args...)...)
	var errb strings.Builder
	cmd.Stderr = &errb
	began := time.Now()
	out, err := cmd.Output()
	wall = time.Since(began)
	var ee *exec.ExitError
	if errors.As(err, &ee) && slices.Contains(ok, ee.ExitCode()) {
		err = nil
	}
	if err != nil {
		b.Fatalf("imagefleet %s: %v\n%s", strings.Join(args, " "), err, tailString(errb.String(), 20))
	}
	raw, err := os.ReadFile(f)
	if err != nil {
		b.Fatal(err)
	}
	// After a non-zero exit, /usr/bin/time writes "Command exited with non-zero status N" first: the
	// figures are the last line.
	fs := strings.Fields(tailString(string(raw), 1))
	if len(fs) != 3 {
		b.Fatalf("/usr/bin/time: %q", raw)
	}
	kb, _ := strconv.ParseInt(fs[0], 10, 64)
	u, _ := strconv.ParseFloat(fs[1], 64)
	s, _ := strconv.ParseFloat(fs[2], 64)
	return out, wall, kb << 10, time.Duration((u + s) * float64(time.Second))
}

func tailString(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// floorRounds is how many times requestBaseline runs the floor's batches; the floor is their median. One
// measure moved between 17 and 48 ms from one to the next on 1,000 nodes (docs/runs/2026-11-fleet-rollouts.md),
// and every ratio to the floor carried that spread.
const floorRounds = 5

// requestBaseline is the floor of a rollout's messaging on this cluster, measured in the same run: the
// same slow-start batches over n nodes, each node a core NATS request from one connection to a responder
// that answers at once (n subscriptions on a second connection), at most 1,000 requests in flight. The
// batches run floorRounds times over the same responders; it returns the median and every round.
func requestBaseline(b testing.TB, c *natsCluster, n int) (time.Duration, []time.Duration) {
	b.Helper()
	subject := func(i int) string { return fmt.Sprintf("imagefleet.bench.baseline.%d", i) }
	subjects := make([]string, n)
	for i := range subjects {
		subjects[i] = subject(i)
	}
	ctx := b.Context()
	defer answerAtOnce(b, c, "scale-baseline-responder", subjects, func(string) any { return struct{}{} })()
	rounds := make([]time.Duration, 0, floorRounds)
	for range floorRounds {
		began := time.Now()
		next := 0
		sem := make(chan struct{}, 1000)
		for _, size := range fleet.PlanBatches(n, 1) {
			var bw sync.WaitGroup
			for i := next; i < next+size; i++ {
				sem <- struct{}{}
				bw.Go(func() {
					defer func() { <-sem }()
					rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
					defer rcancel()
					if err := c.Bus.Request(rctx, subject(i), struct{}{}, &struct{}{}); err != nil {
						b.Errorf("baseline request %d: %v", i, err)
					}
				})
			}
			bw.Wait()
			next += size
		}
		rounds = append(rounds, time.Since(began))
	}
	sorted := slices.Clone(rounds)
	slices.Sort(sorted)
	return sorted[len(sorted)/2], rounds
}

// answerAtOnce serves every subject on one connection of its own to c, answering each request at once with
// answer(subject). It returns, with the func that stops them, once every responder has answered a request
// from c.Bus (its interest known on the server c.Bus is connected to); a responder that cannot subscribe,
// or does not answer within answerReadyFor, fails the benchmark.
func answerAtOnce(b testing.TB, c *natsCluster, name string, subjects []string, answer func(subject string) any) (stop func()) {
	b.Helper()
	ctx, cancel := context.WithCancel(b.Context())
	resp, err := bus.Connect(ctx, c.URL, bus.Options{Name: name})
	if err != nil {
		cancel()
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	stop = func() {
		cancel()
		wg.Wait()
		resp.Close()
	}
	serveErr := make(chan error, 1)
	for _, subject := range subjects {
		wg.Go(func() {
			err := resp.Serve(ctx, subject, "", func(context.Context, []byte) (any, error) { return answer(subject), nil })
			if err != nil && ctx.Err() == nil {
				select {
				case serveErr <- fmt.Errorf("serve %s: %w", subject, err):
				default:
				}
			}
		})
	}
	deadline := time.Now().Add(answerReadyFor)
	for _, subject := range subjects {
		for {
			rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
			err := c.Bus.Request(rctx, subject, struct{}{}, &json.RawMessage{})
			rcancel()
			if err == nil {
				break
			}
			select {
			case serr := <-serveErr:
				err = serr
			default:
				if ctx.Err() == nil && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
					continue
				}
			}
			stop()
			b.Fatalf("responder %s not answering: %v", subject, err)
		}
	}
	return stop
}

// answerReadyFor bounds answerAtOnce's wait for its responders to answer.
const answerReadyFor = 2 * time.Minute

// hollowFleet is a cluster and n hollow agents, Ready.
type hollowFleet struct {
	c       *natsCluster
	h       *proc
	n       int
	streams clusterStreams
	names   []string
	startup time.Duration
	rssPer  float64 // hollow process RSS per agent, bytes, once all are Ready
	monitor []string
}

func startHollowFleet(b *testing.B, bin string, n int, s clusterStreams, extra ...string) *hollowFleet {
	return startHollowFleetOf(b, bin, bin, n, s, extra...)
}

// startHollowFleetOf is startHollowFleet with the hollow agents of agentBin (the cluster is bin's).
func startHollowFleetOf(b *testing.B, bin, agentBin string, n int, s clusterStreams, extra ...string) *hollowFleet {
	b.Helper()
	r := strconv.Itoa(s.replicas)
	c := startNATSClusterR(b, bin, s.replicas, s.pull)
	h := startHollow(b, agentBin, "hollow", c.URL, n, append([]string{"--stream-replicas", r}, extra...)...)
	names, startup := waitReady(b, c.Bus, h, "hollow-", n, time.Duration(n/50+120)*time.Second)
	st, err := readProcStat(h.cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	return &hollowFleet{c: c, h: h, n: n, streams: s, names: names, startup: startup, rssPer: float64(st.RSS) / float64(n), monitor: c.monitorURLs(b)}
}

// rolloutCost runs one rollout command and reports what it cost: wall, orchestrator peak RSS and CPU,
// servers' CPU and peak RSS, hollow process CPU, and server messages and JetStream API requests per node
// (in_msgs and /jsz api.total over the three servers during the rollout, less the idle rates measured just
// before).
type rolloutCost struct {
	res             events.RolloutResult
	warnings        string // the hollow log's warnings and errors written during the rollout, by message
	wall, orchCPU   time.Duration
	orchRSS         int64
	nats, hollowUse procCost
	msgsPerNode     float64
	apiPerNode      float64 // JetStream API requests the servers handled per node, less the idle rate
}

func (f *hollowFleet) run(b *testing.B, bin string, args ...string) rolloutCost {
	b.Helper()
	ctx := b.Context()
	// The idle message rate (heartbeats, consumers' pull requests) over 3 s, to take out of the figure.
	m0, err := serverMsgs(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	a0, err := serverJSAPI(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	time.Sleep(3 * time.Second) // the idle window measured
	m1, err := serverMsgs(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	idleRate := float64(m1-m0) / 3
	a1, err := serverJSAPI(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	apiIdleRate := float64(a1-a0) / 3
	ns, hs := f.sample(b)
	var rc rolloutCost
	args = append(args, "--nats", f.c.URL, "--stream-replicas", strconv.Itoa(f.streams.replicas), "--timeout", "5m", "-o", "json")
	// IMAGEFLEET_SCALE_ROLLOUT_ARGS: more flags for every rollout (e.g. "--max-in-flight 250 --node-timeout 3m").
	extra := strings.Fields(testenv.String(b, "IMAGEFLEET_SCALE_ROLLOUT_ARGS"))
	args = append(args, extra...)
	// With a failure budget (--max-failures in IMAGEFLEET_SCALE_ROLLOUT_ARGS), a rollout that went through
	// every batch within it is measured, its failed nodes reported; without one, any failure fails the run.
	budget := slices.ContainsFunc(extra, func(a string) bool { return strings.HasPrefix(a, "--max-failures") })
	// Exit 2 (some nodes failed) still prints the result: it is read, so a failed run says why its nodes
	// failed, not only the progress lines' tail.
	logFrom := fileSize(f.h.log)
	out, wall, rss, cpu := timedRunExit(b, bin, []int{2}, args...)
	rc.nats, rc.hollowUse = ns.Stop(), hs.Stop()
	rc.warnings = logWarnings(f.h.log, logFrom)
	m2, err := serverMsgs(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	a2, err := serverJSAPI(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	rc.wall, rc.orchRSS, rc.orchCPU = wall, rss, cpu
	rc.msgsPerNode = (float64(m2-m1) - idleRate*wall.Seconds()) / float64(f.n)
	rc.apiPerNode = (float64(a2-a1) - apiIdleRate*wall.Seconds()) / float64(f.n)
	if err := json.Unmarshal(out, &rc.res); err != nil {
		b.Fatalf("%v\n%s", err, out)
	}
	if budget && rc.res.StopReason == events.RolloutCompleted && rc.res.Succeeded+rc.res.FailedTotal() == f.n {
		b.Logf("rollout %s: %d of %d failed, within --max-failures (%d allowed): %v", rc.res.ID, rc.res.FailedTotal(), f.n,
			rc.res.FailureBudget, rc.res.Failed[:min(5, len(rc.res.Failed))])
	} else if rc.res.Succeeded != f.n || len(rc.res.Failed) != 0 {
		b.Fatalf("rollout %s: %d of %d succeeded, %d failed, %d not started (%s); failures by error:\n%s", rc.res.ID,
			rc.res.Succeeded, f.n, rc.res.FailedTotal(), rc.res.NotStarted, rc.res.StopReason, failuresByError(rc.res.Failed))
	}
	return rc
}

// idleCost is what the fleet costs while nothing runs: heartbeats, pull requests, periodic passes.
type idleCost struct {
	window          time.Duration
	nats, hollowUse procCost
	msgs            int64 // handed to the servers (/varz in_msgs, summed)
	periods         string
}

// heartbeatPeriods counts the periods the nodes' last heartbeats carry: "20s x 9990, 10s x 10".
func heartbeatPeriods(b *testing.B, bc *bus.Bus) string {
	b.Helper()
	kv, err := bc.KVExisting(b.Context(), events.NodesBucket)
	if err != nil {
		b.Fatal(err)
	}
	entries, err := kv.List(b.Context(), "")
	if err != nil {
		b.Fatal(err)
	}
	counts := map[time.Duration]int{}
	for _, e := range entries {
		var a events.NodeAlive
		if err := json.Unmarshal(e.Value, &a); err != nil {
			b.Fatalf("heartbeat %s: %v", e.Key, err)
		}
		counts[a.Period.Duration]++
	}
	periods := slices.Sorted(maps.Keys(counts))
	var parts []string
	for i := len(periods) - 1; i >= 0; i-- {
		parts = append(parts, fmt.Sprintf("%s x %d", periods[i], counts[periods[i]]))
	}
	return strings.Join(parts, ", ")
}

// sample starts sampling the three servers and the hollow process.
func (f *hollowFleet) sample(b *testing.B) (servers, hollow *procSampler) {
	b.Helper()
	servers, err := sampleProcs(f.c.serverPIDs()...)
	if err != nil {
		b.Fatal(err)
	}
	if hollow, err = sampleProcs(f.h.cmd.Process.Pid); err != nil {
		b.Fatal(err)
	}
	return servers, hollow
}

// idle samples the servers and the hollow agents for window while no rollout runs.
func (f *hollowFleet) idle(b *testing.B, window time.Duration) idleCost {
	b.Helper()
	ctx := b.Context()
	m0, err := serverMsgs(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	ns, hs := f.sample(b)
	time.Sleep(window)
	ic := idleCost{window: window, nats: ns.Stop(), hollowUse: hs.Stop(), periods: heartbeatPeriods(b, f.c.Bus)}
	m1, err := serverMsgs(ctx, f.monitor)
	if err != nil {
		b.Fatal(err)
	}
	ic.msgs = m1 - m0
	return ic
}

func (ic idleCost) report(b *testing.B, f *hollowFleet) {
	secs := ic.window.Seconds()
	b.Logf("idle %s: servers %.2f CPU-s/s, %.0f MiB; hollow agents %.2f CPU-s/s; %.0f server messages/s (%.2f per node per second); heartbeat periods %s",
		ic.window, ic.nats.CPU.Seconds()/secs, float64(ic.nats.PeakRSS)/(1<<20), ic.hollowUse.CPU.Seconds()/secs,
		float64(ic.msgs)/secs, float64(ic.msgs)/secs/float64(f.n), ic.periods)
	b.ReportMetric(ic.nats.CPU.Seconds()/secs, "nats-cpu-s/s")
	b.ReportMetric(ic.hollowUse.CPU.Seconds()/secs, "hollow-cpu-s/s")
	b.ReportMetric(float64(ic.msgs)/secs/float64(f.n), "server-msgs/node/s")
}

// failuresByError groups a rollout's failed nodes by their error, most frequent first, naming up to three
// nodes of each: "11 x kv update ...: context deadline exceeded (hollow-06112, ...)".
func failuresByError(failed []events.RolloutNodeError) string {
	nodes := map[string][]string{}
	for _, f := range failed {
		nodes[f.Error] = append(nodes[f.Error], f.Node)
	}
	errs := slices.Collect(maps.Keys(nodes))
	slices.SortFunc(errs, func(a, b string) int {
		if c := len(nodes[b]) - len(nodes[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	var sb strings.Builder
	for _, e := range errs {
		fmt.Fprintf(&sb, "  %d x %s (%s)\n", len(nodes[e]), e, strings.Join(nodes[e][:min(3, len(nodes[e]))], ", "))
	}
	return sb.String()
}

func (rc rolloutCost) report(b *testing.B, f *hollowFleet, baseline time.Duration) {
	// Each rollout of the row on a line of its own: a benchmark metric keeps only the last iteration's
	// value, and a goal holds for every run.
	b.Logf("rollout %s: command %.3f s (%.1fx the floor), run %.3f s (%.1fx); %.2f server messages and %.2f JetStream API requests per node; CPU agents %.2f s, servers %.2f s, orchestrator %.2f s; peak RSS servers together %.0f MiB, orchestrator %.0f MiB; failed %d",
		rc.res.ID, rc.wall.Seconds(), rc.wall.Seconds()/baseline.Seconds(), rc.res.Duration.Seconds(), rc.res.Duration.Seconds()/baseline.Seconds(),
		rc.msgsPerNode, rc.apiPerNode, rc.hollowUse.CPU.Seconds(), rc.nats.CPU.Seconds(), rc.orchCPU.Seconds(),
		float64(rc.nats.PeakRSS)/(1<<20), float64(rc.orchRSS)/(1<<20), rc.res.FailedTotal())
	b.ReportMetric(rc.wall.Seconds(), "s/rollout")
	b.ReportMetric(rc.wall.Seconds()/baseline.Seconds(), "x-baseline")
	// The rollout's own run (RolloutResult.Duration: its stream checked and plan recorded, the batches, up
	// to its last outcome), without the command's start, connect, node selection and finished record: the
	// part the floor's batches compare with directly.
	b.ReportMetric(rc.res.Duration.Seconds(), "run-s/rollout")
	b.ReportMetric(rc.res.Duration.Seconds()/baseline.Seconds(), "run-x-baseline")
	b.ReportMetric(float64(rc.res.FailedTotal()), "failed-nodes")
	b.ReportMetric(rc.msgsPerNode, "server-msgs/node")
	b.ReportMetric(rc.apiPerNode, "js-api/node")
	b.ReportMetric(float64(rc.orchRSS)/(1<<20), "orch-maxrss-MiB")
	b.ReportMetric(rc.orchCPU.Seconds(), "orch-cpu-s")
	b.ReportMetric(rc.nats.CPU.Seconds(), "nats-cpu-s")
	b.ReportMetric(float64(rc.nats.PeakRSS)/(1<<20), "nats-rss-MiB")
	b.ReportMetric(rc.hollowUse.CPU.Seconds(), "hollow-cpu-s")
	b.ReportMetric(f.rssPer/(1<<10), "hollow-rss-KiB/agent")
	b.ReportMetric(f.startup.Seconds(), "startup-s")
	if t := nodeTimes(rc.res.Nodes); t != "" {
		b.Logf("rollout %s: %s", rc.res.ID, t)
	}
	if rc.warnings != "" {
		b.Logf("rollout %s: the hollow agents warned meanwhile:\n%s", rc.res.ID, rc.warnings)
	}
}

// fileSize is path's size (0 when it cannot be read).
func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// logWarnings counts the WARN and ERROR lines of a hollow log from offset on by message, most frequent
// first (at most 8 messages, with one node each), so a rollout's late or failed nodes come with what their
// agents said: a consumer that pulled anew, a write that was retried ("" when there are none).
func logWarnings(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	counts, nodeOf := map[string]int{}, map[string]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		level := logField(line, "level")
		if level != "WARN" && level != "ERROR" {
			continue
		}
		key := level + " " + logField(line, "msg")
		counts[key]++
		if _, ok := nodeOf[key]; !ok {
			nodeOf[key] = logField(line, "node")
		}
	}
	keys := slices.Collect(maps.Keys(counts))
	slices.SortFunc(keys, func(a, b string) int {
		if c := counts[b] - counts[a]; c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	var sb strings.Builder
	for _, k := range keys[:min(8, len(keys))] {
		fmt.Fprintf(&sb, "  %d x %s (%s, ...)\n", counts[k], k, nodeOf[k])
	}
	return sb.String()
}

// logField is the value of key in one slog text line (quoted values unquoted), "" when absent.
func logField(line, key string) string {
	i := strings.Index(line, " "+key+"=")
	if i < 0 {
		if !strings.HasPrefix(line, key+"=") {
			return ""
		}
		i = -1
	}
	v := line[i+len(key)+2:]
	if strings.HasPrefix(v, `"`) {
		if u, err := strconv.QuotedPrefix(v); err == nil {
			if s, err := strconv.Unquote(u); err == nil {
				return s
			}
		}
		return v
	}
	if j := strings.IndexByte(v, ' '); j >= 0 {
		return v[:j]
	}
	return v
}

// nodeTimes summarizes how long the nodes of a rollout took, each from its claim to its outcome:
// percentiles and the slowest three, so a wall time stretched by a few late nodes says which ("" when the
// result lists none).
func nodeTimes(nodes []events.RolloutNodeResult) string {
	if len(nodes) == 0 {
		return ""
	}
	byTime := slices.Clone(nodes)
	slices.SortStableFunc(byTime, func(a, b events.RolloutNodeResult) int { return cmp.Compare(a.Duration.Duration, b.Duration.Duration) })
	at := func(q float64) time.Duration {
		return byTime[min(len(byTime)-1, int(q*float64(len(byTime))))].Duration.Duration.Round(time.Millisecond)
	}
	var slow []string
	for _, n := range slices.Backward(byTime[max(0, len(byTime)-3):]) {
		slow = append(slow, fmt.Sprintf("%s %s (batch %d)", n.Node, n.Duration.Duration.Round(time.Millisecond), n.Batch))
	}
	// The slowest node of each batch: a batch waits for all its nodes, so these add up to most of the run,
	// and they say whether the small first batches (latency) or the large last ones (throughput) take it.
	var slowest []time.Duration
	for _, n := range nodes {
		for len(slowest) < n.Batch {
			slowest = append(slowest, 0)
		}
		if n.Batch > 0 {
			slowest[n.Batch-1] = max(slowest[n.Batch-1], n.Duration.Duration)
		}
	}
	var perBatch []string
	for i, d := range slowest {
		perBatch = append(perBatch, fmt.Sprintf("%d:%s", i+1, d.Round(time.Millisecond)))
	}
	return fmt.Sprintf("node times p50 %s, p90 %s, p99 %s, p99.9 %s; slowest %s; slowest by batch %s", at(0.5), at(0.9), at(0.99), at(0.999),
		strings.Join(slow, ", "), strings.Join(perBatch, " "))
}

// BenchmarkHollowFleet measures fleet GC (dry run, then real) and a fleet pre-pull of one image (hollow
// registry delay 100 ms) across N hollow agents with real workers on a three-server cluster. Each rollout
// is compared with the floor (op=floor: requestBaseline, the same slow-start batches of bare
// request/replies on the same cluster, measured in the same run: x-baseline), and reports the servers'
// messages and JetStream API requests per node (server-msgs/node, js-api/node) besides CPU and memory.
// op=machinery runs the dry run's command against responders that answer at once: the rollout's own cost
// between the floor and the nodes' work. Run it with -benchtime 1x: a second real GC finds nothing to remove.
// Rows: nodes=N/streams=S/op=O (fleetSizes, streamRows). With IMAGEFLEET_BASELINE_BINARY set to an earlier build, a fleet of its agents is measured after this
// build's (bin=baseline; the cluster and the fleet command are this build's in both).
func BenchmarkHollowFleet(b *testing.B) {
	bin := imagefleetBinary(b)
	nofile := raiseNoFile(b)
	bins := agentBinaries(b, bin)
	for _, ab := range bins {
		prefix := "" // without a baseline, the names of before
		if len(bins) > 1 {
			prefix = "bin=" + ab.name + "/"
		}
		for _, n := range testenv.Rows(fleetSizes) {
			for _, s := range testenv.Rows(streamRows) {
				benchHollowFleet(b, bin, ab.path, prefix+n.Name+"/"+s.Name, n.Value, s.Value, nofile)
			}
		}
	}
}

// benchHollowFleet runs BenchmarkHollowFleet's row name: n agents of agentBin on a cluster of s.
func benchHollowFleet(b *testing.B, bin, agentBin, name string, n int, s clusterStreams, nofile uint64) {
	b.Run(name, func(b *testing.B) {
		// IMAGEFLEET_SCALE_HOLLOW_ARGS: more flags for the hollow agents (e.g. "--heartbeat-period 20s").
		hollowArgs := append([]string{"--images-per-node", "8", "--pull-delay", "100ms"}, strings.Fields(testenv.String(b, "IMAGEFLEET_SCALE_HOLLOW_ARGS"))...)
		f := startHollowFleetOf(b, bin, agentBin, n, s, hollowArgs...)
		b.Logf("%d agents Ready in %s; hollow RSS %.0f KiB per agent; RLIMIT_NOFILE %d", n, f.startup.Round(time.Millisecond), f.rssPer/1024, nofile)
		// The floor: bare request/replies in the rollouts' slow-start batches, on the same cluster and fleet.
		// Every rollout row is reported as a ratio to it (x-baseline); a rollout row picked without this one
		// measures it before its first rollout.
		var baseline time.Duration
		floor := func(b *testing.B) time.Duration {
			if baseline == 0 {
				var rounds []time.Duration
				baseline, rounds = requestBaseline(b, f.c, n)
				var each []string
				for _, r := range rounds {
					each = append(each, r.Round(time.Millisecond).String())
				}
				b.Logf("baseline: %d request/replies in slow-start batches: %s, the median of %s", n,
					baseline.Round(time.Millisecond), strings.Join(each, ", "))
			}
			return baseline
		}
		b.Run("op=floor", func(b *testing.B) {
			for range b.N {
				baseline = 0
				b.ReportMetric(floor(b).Seconds(), "s/rollout")
			}
		})
		b.Run("op=idle", func(b *testing.B) {
			for range b.N {
				f.idle(b, 10*time.Second).report(b, f)
			}
		})
		// The rollout itself, with nothing behind it: the real fleet command on the same cluster, each node
		// answered at once by a responder (one connection for all of them, as the floor's) with an empty dry
		// run's result. Its records (plan, claims, outcome groups, summary) and batches are a dry run's; the
		// nodes' work is not. Between it and the floor is what the rollout's bookkeeping costs, between it
		// and op=gc-dryrun what the nodes' passes cost.
		b.Run("op=machinery", func(b *testing.B) {
			base := floor(b) // before the responders subscribe: the floor's cluster as every row finds it
			names := make([]string, n)
			subjects := make([]string, n)
			for i := range names {
				// Short names: --nodes is one argument, and Linux refuses one over 128 KiB (10,000 nodes
				// named "m00000" make 70 KB).
				names[i] = fmt.Sprintf("m%05d", i)
				subjects[i] = events.CommandSubject(names[i], events.VerbGC)
			}
			byNode := map[string]string{}
			for i, s := range subjects {
				byNode[s] = names[i]
			}
			defer answerAtOnce(b, f.c, "scale-machinery-responder", subjects, func(subject string) any {
				return events.GCResult{Node: byNode[subject], DryRun: true, AllUnused: true, Trigger: events.GCTriggerManual,
					Removed: []events.GCRemoved{}, Skipped: []events.GCSkipped{}}
			})()
			for range b.N {
				rc := f.run(b, bin, "fleet", "gc", "--dry-run", "--all-unused", "--nodes", strings.Join(names, ","))
				rc.report(b, f, base)
			}
		})
		b.Run("op=gc-dryrun", func(b *testing.B) {
			base := floor(b)
			for range b.N {
				rc := f.run(b, bin, "fleet", "gc", "--dry-run", "--all-unused")
				rc.report(b, f, base)
			}
		})
		// A new tag for every pre-pull of the fleet: the testing package runs a row once with b.N 1, then
		// again with the -benchtime count, and a tag pulled before is found present (no pull, about two
		// thirds of the messages).
		prepulls := 0
		b.Run("op=prepull", func(b *testing.B) {
			base := floor(b)
			for range b.N {
				prepulls++
				rc := f.run(b, bin, "fleet", "pull", fmt.Sprintf("registry.local/bench/prepull:v%d", prepulls), "--node-timeout", "5m")
				rc.report(b, f, base)
				// The floor of a pre-pull: one pull delay per batch after the messaging floor.
				b.ReportMetric(float64(len(rc.res.Batches)), "batches")
			}
		})
		b.Run("op=gc", func(b *testing.B) {
			base := floor(b)
			for range b.N {
				rc := f.run(b, bin, "fleet", "gc", "--all-unused")
				if rc.res.FreedBytes <= 0 {
					b.Errorf("gc freed %d bytes", rc.res.FreedBytes)
				}
				rc.report(b, f, base)
			}
		})
		// At rest again, minutes after the start: the heartbeat periods settled.
		b.Run("op=idle-after", func(b *testing.B) {
			for range b.N {
				f.idle(b, 10*time.Second).report(b, f)
			}
		})
	})
}

// inventoryModes are the inventory's ways of consuming that BenchmarkInventoryCatchUp compares: shared (the
// one durable fleet-inventory) and partitioned (the 16 partition durables). Each is a row (inventory=M) that
// -bench picks.
var inventoryModes = []string{"shared", "partitioned"}

// inventoryReplicas are the replica counts BenchmarkInventoryCatchUp compares, a row (replicas=R) each that
// -bench picks, so one row can be run again alone: 1, 2 and 4 by default, 8 only when -bench names it.
var inventoryReplicas = testenv.IntRows("replicas", []int{1, 2, 4}, []int{8})

// shortNodes names the nodes (up to 5) with fewer than want image.detected events in the events stream, and
// what the hollow log says of each (its last 15 lines naming it): a node whose events are missing, found.
func shortNodes(ctx context.Context, f *hollowFleet, want uint64) string {
	counts, err := f.c.Bus.SubjectCounts(ctx, events.EventsStream, "imagefleet.evt.*.image.detected")
	if err != nil {
		return err.Error()
	}
	raw, _ := os.ReadFile(f.h.log)
	lines := strings.Split(string(raw), "\n")
	var sb strings.Builder
	short := 0
	for _, node := range f.names {
		subject := events.EventSubject(node, events.EntityImage, events.ActionDetected)
		if counts[subject] >= want {
			continue
		}
		if short++; short > 5 {
			continue
		}
		var said []string
		for _, l := range lines {
			if strings.Contains(l, node+" ") || strings.Contains(l, node+"\"") || strings.HasSuffix(l, node) {
				said = append(said, l)
			}
		}
		fmt.Fprintf(&sb, "%s: %d image.detected events; %d log lines, the last %d:\n  %s\n", node, counts[subject], len(said),
			min(15, len(said)), strings.Join(said[max(0, len(said)-15):], "\n  "))
	}
	return fmt.Sprintf("%d nodes short of %d events\n%s", short, want, sb.String())
}

// detectorTrouble returns the hollow log's lines in which a detector said it failed (up to n, the last):
// what a node whose image events are missing said about it.
func detectorTrouble(path string, n int) string {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.Contains(l, "worker=detector") || strings.Contains(l, "image events") {
			out = append(out, l)
		}
	}
	return fmt.Sprintf("%d detector warnings; the last %d:\n%s", len(out), min(n, len(out)), strings.Join(out[max(0, len(out)-n):], "\n"))
}

// BenchmarkInventoryCatchUp measures the fleet inventory catching up after N nodes (re)start with 50 images
// each: the hollow fleet starts and its detectors publish N x 50 image.detected events while no inventory
// runs; then R inventory replicas (`imagefleet agent --workers inventory`, each its own process) start on
// the shared durable or (inventory=partitioned, after the server copied the backlog into
// events.InventoryStream) on the 16 partition durables, and the benchmark times them until the inventory
// bucket holds every placement.
// Each replica count gets its own cluster and fleet, so every run starts from the same backlog.
// Rows: nodes=N/streams=S/inventory=M/replicas=R (fleetSizes, streamRows, inventoryModes, inventoryReplicas).
//
// IMAGEFLEET_SCALE_REPLICA_CPU (a share of one core, such as 0.1) holds each replica to that share in a CPU
// cgroup of its own (root only), as separate hosts would give each its own CPU: on this 2-core machine the
// uncapped replicas and the servers share two cores, so more replicas cannot add (docs/benchmarks.md).
// Capped well below what the servers leave, the replicas are the bound, and their rate against their number
// is what the partitioning gives.
func BenchmarkInventoryCatchUp(b *testing.B) {
	bin := imagefleetBinary(b)
	raiseNoFile(b)
	cpuShare, err := parseCPUCap(testenv.String(b, "IMAGEFLEET_SCALE_REPLICA_CPU"))
	if err != nil {
		b.Fatalf("IMAGEFLEET_SCALE_REPLICA_CPU=%v", err)
	}
	for _, nr := range testenv.Rows(fleetSizes) {
		for _, sr := range testenv.Rows(streamRows) {
			for _, mode := range inventoryModes {
				var rate1 float64
				for _, rr := range testenv.Rows(inventoryReplicas) {
					n, streams, replicas := nr.Value, sr.Value, rr.Value
					b.Run(nr.Name+"/"+sr.Name+"/inventory="+mode+"/"+rr.Name, func(b *testing.B) {
						for range b.N {
							b.StopTimer()
							// A detection that fails (the records bucket refusing a node's list past the stream's
							// consumer limit while every agent starts at once: docs/scale.md) is tried again next
							// detect period: 20 s here, so the backlog fills within the wait below.
							f := startHollowFleet(b, bin, n, streams, "--images-per-node", "50", "--image-detect-period", "20s")
							ctx := b.Context()
							want := uint64(n * 50)
							// The events stream holds nothing but the detectors' image.detected events yet: its message
							// count (one cheap stream info) tells when they are all in.
							began, last, lastChange := time.Now(), uint64(0), time.Now()
							for {
								info, err := f.c.Bus.Stream(ctx, events.EventsStream)
								if err != nil {
									b.Logf("events stream info: %v", err)
								}
								got := info.Messages
								if got >= want {
									break
								}
								if got != last {
									last, lastChange = got, time.Now()
								}
								if time.Since(lastChange) > 90*time.Second || time.Since(began) > 15*time.Minute {
									b.Fatalf("%d of %d image.detected events after %s\n%s\n%s", got, want, time.Since(began).Round(time.Second),
										detectorTrouble(f.h.log, 20), shortNodes(ctx, f, 50))
								}
								time.Sleep(time.Second)
							}
							b.Logf("%d image.detected events in the stream %s after the agents were Ready", want, time.Since(began).Round(time.Second))
							// The nodes stop: what is measured is the inventory draining the backlog, not the agents.
							f.h.stop(syscall.SIGTERM)
							var backlog uint64
							bustest.Eventually(b, "the image events backlog counted", time.Minute, func() (err error) {
								backlog, err = f.c.Bus.CountPending(ctx, events.EventsStream, events.ImageEventsFilter, 0)
								return err
							})
							// The partitioned copy (events.InventoryStream, as bus init --inventory-partitioned makes it)
							// fills from the events stream; its size is the partitioning's storage cost (per server, R3).
							partitioned := mode == "partitioned"
							var copyBytes uint64
							if partitioned {
								if err := fleet.EnsureInventoryStream(ctx, f.c.Bus, streams.replicas); err != nil {
									b.Fatal(err)
								}
							}
							bustest.Eventually(b, "the partitioned copy holds the backlog", 5*time.Minute, func() error {
								if !partitioned {
									return nil
								}
								info, err := f.c.Bus.Stream(ctx, events.InventoryStream)
								if err != nil {
									return err
								}
								if info.Messages < backlog {
									return fmt.Errorf("%d of %d copied", info.Messages, backlog)
								}
								copyBytes = info.Bytes
								return nil
							})
							evInfo, _ := f.c.Bus.Stream(ctx, events.EventsStream)
							urls := f.c.monitorURLs(b)
							msgs0, msgsErr := serverMsgs(ctx, urls)
							b.StartTimer()
							t0 := time.Now()
							var pids []int
							var groups []*cpuCgroup
							for r := range replicas {
								args := []string{"agent", "--node", fmt.Sprintf("fleet-inventory-%d", r+1),
									"--nats", f.c.URL, "--workers", "inventory", "--stream-replicas", strconv.Itoa(streams.replicas), "--data-dir", b.TempDir()}
								if partitioned {
									args = append(args, "--inventory-partitioned")
								}
								p := startProc(b, fmt.Sprintf("inventory-%d", r+1), bin, args...)
								pids = append(pids, p.cmd.Process.Pid)
								if cpuShare > 0 {
									groups = append(groups, capCPU(b, p.cmd.Process.Pid, cpuShare))
								}
							}
							var s *procSampler
							watched := append(append([]int{}, pids...), f.c.serverPIDs()...)
							cpu0 := map[int]time.Duration{}
							for _, p := range watched {
								st, _ := readProcStat(p)
								cpu0[p] = st.CPU
							}
							// Caught up: every image.detected event (one distinct node and image each) is a key of the
							// inventory bucket. (A consumer's NumPending read right after a replica made it can be 0
							// before the server counted its backlog: the previous end condition, a durable with nothing
							// pending, once ended a 2-replica run at 0.2 s.)
							for {
								if s == nil {
									s, _ = sampleProcs(watched...)
								}
								info, err := f.c.Bus.Stream(ctx, "KV_"+events.InventoryBucket)
								if err == nil && info.Messages >= backlog {
									break
								}
								if time.Since(t0) > 30*time.Minute {
									b.Fatalf("inventory not caught up after 30 minutes: %+v %v", info, err)
								}
								time.Sleep(200 * time.Millisecond)
							}
							wall := time.Since(t0)
							b.StopTimer()
							// The replicas answer for the whole fleet (partitioned: gathered from their parts).
							bustest.Eventually(b, "the inventory answers for every node", time.Minute, func() error {
								qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
								defer cancel()
								var rep events.InventoryReply
								if err := f.c.Bus.Request(qctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryNodes, Limit: 1}, &rep); err != nil {
									return err
								}
								if rep.Total != n {
									return fmt.Errorf("nodes total %d, want %d", rep.Total, n)
								}
								return nil
							})
							// Messages handed to the servers (clients' and routes': Raft replication included) per event.
							if msgs1, err := serverMsgs(ctx, urls); err == nil && msgsErr == nil {
								b.ReportMetric(float64(msgs1-msgs0)/float64(backlog), "server-msgs/event")
							}
							var replicaCPU, serversCPU time.Duration
							serverCPU := make([]string, 0, 3)
							for i, p := range watched {
								st, _ := readProcStat(p)
								d := st.CPU - cpu0[p]
								if i < len(pids) {
									replicaCPU += d
									if cpuShare > 0 {
										// The cap held: no replica used more than its share of the wall time (10 % and
										// one quota period over, for the kernel's accounting). Its throttled time says
										// whether the cap was the bound (little or none: it waited on the servers).
										limit := time.Duration(cpuShare*1.1*float64(wall)) + cpuCapPeriod
										thr, err := groups[i].throttled()
										if err != nil {
											b.Fatal(err)
										}
										if d > limit {
											b.Fatalf("replica %d: %s of CPU in %s (cap %.2f core): the cap did not hold",
												i+1, d.Round(time.Millisecond), wall.Round(time.Millisecond), cpuShare)
										}
										b.Logf("replica %d: %s of CPU in %s (%.0f %% of its cap), throttled %s", i+1, d.Round(time.Millisecond),
											wall.Round(time.Millisecond), 100*d.Seconds()/(cpuShare*wall.Seconds()), thr.Round(time.Millisecond))
									}
								} else {
									serversCPU += d
									serverCPU = append(serverCPU, d.Round(10*time.Millisecond).String())
								}
							}
							// CPU per 1,000 events of the replicas and of the three servers: what separate hosts would
							// need, where on this machine they share its cores.
							b.ReportMetric(replicaCPU.Seconds()*1000/float64(backlog), "replica-cpu-s/1k-events")
							b.ReportMetric(serversCPU.Seconds()*1000/float64(backlog), "server-cpu-s/1k-events")
							b.Logf("replicas' CPU %s; each server's CPU %s; the copy stream %.1f MiB (the events stream %.1f MiB)",
								replicaCPU.Round(10*time.Millisecond), strings.Join(serverCPU, " / "), float64(copyBytes)/(1<<20), float64(evInfo.Bytes)/(1<<20))
							b.ReportMetric(replicaCPU.Seconds(), "replica-cpu-s")
							b.ReportMetric(float64(copyBytes)/(1<<20), "copy-MiB")
							var cost procCost
							if s != nil {
								cost = s.Stop()
							}
							rate := float64(backlog) / wall.Seconds()
							if replicas == 1 {
								rate1 = rate
							}
							b.ReportMetric(rate, "events/s")
							b.ReportMetric(float64(backlog), "events")
							b.ReportMetric(wall.Seconds(), "s/catch-up")
							if rate1 > 0 {
								b.ReportMetric(rate/rate1, "x-1-replica")
							}
							b.ReportMetric(cost.CPU.Seconds(), "cpu-s")
							b.ReportMetric(float64(cost.PeakRSS)/(1<<20), "rss-MiB")
							if cpuShare > 0 {
								b.ReportMetric(cpuShare, "replica-core-cap")
							}
						}
					})
				}
			}
		}
	}
}
