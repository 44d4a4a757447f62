package integration_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// The scale harness: a three-server NATS cluster started from deploy/nats/cluster with the built binary,
// hollow agents started with `imagefleet hollow` (the real node workers over hollow CRI runtimes), and the
// readers the scale test and benchmarks share: who is Ready in the registry, what each node did according
// to the events and rollout streams, and what a process costs according to /proc.

// natsCluster is three nats-servers (`imagefleet bus --config`) and a test connection to all of them.
type natsCluster struct {
	servers []*proc
	urls    []string
	// URL is every server's client URL, comma-separated, as agents and commands take it.
	URL string
	Bus *bus.Bus
}

// startNATSCluster starts the cluster and waits until it creates R3 streams (`imagefleet bus init
// --stream-replicas 3`: every stream and bucket the workers use, on three servers).
func startNATSCluster(t testing.TB, bin string) *natsCluster { return startNATSClusterR(t, bin, 3, 0) }

// startNATSClusterR is startNATSCluster with the given stream replicas, and pullReplicas for the pull
// partitions (0: the streams').
func startNATSClusterR(t testing.TB, bin string, replicas, pullReplicas int) *natsCluster {
	t.Helper()
	confs, urls := clusterConfigs(t)
	c := &natsCluster{urls: urls, URL: strings.Join(urls, ",")}
	for i, conf := range confs {
		c.servers = append(c.servers, startProc(t, fmt.Sprintf("nats-%d", i+1), bin, "bus", "--config", conf))
	}
	b, err := bus.Connect(t.Context(), c.URL, bus.Options{Name: "scale-test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	c.Bus = b
	// pullReplicas: the pull partitions' replicas (and so the node consumers'), for a fleet whose R3 node
	// consumers do not fit the machine while every other stream stays R3 (the streams=r3-pull-r1 row).
	var pullArgs []string
	if pullReplicas > 0 {
		pullArgs = []string{"--pull-replicas", strconv.Itoa(pullReplicas)}
	}
	bustest.Eventually(t, fmt.Sprintf("the cluster's streams and buckets, R%d", replicas), 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		args := []string{"bus", "init", "--stream-replicas", strconv.Itoa(replicas), "--nats", c.URL}
		args = append(args, pullArgs...)
		_, err := cli(ctx, bin, args...)
		if err != nil {
			return err
		}
		return fleet.EnsureRolloutStream(ctx, b, replicas)
	})
	return c
}

// serverPIDs returns the pids of the servers still running.
func (c *natsCluster) serverPIDs() []int {
	var pids []int
	for _, s := range c.servers {
		select {
		case <-s.done:
		default:
			pids = append(pids, s.cmd.Process.Pid)
		}
	}
	return pids
}

// startHollow runs `imagefleet hollow` with n agents against the cluster; extra are more flags.
func startHollow(t testing.TB, bin, name, natsURL string, n int, extra ...string) *proc {
	t.Helper()
	args := append([]string{"hollow", "--nodes", strconv.Itoa(n), "--nats", natsURL, "--data-dir", t.TempDir()}, extra...)
	return startProc(t, name, bin, args...)
}

// readyNodes returns the Ready nodes of the registry whose names start with prefix, sorted.
func readyNodes(ctx context.Context, b *bus.Bus, prefix string) ([]string, error) {
	reg, err := fleet.OpenRegistry(ctx, b, fleet.RegistryOptions{})
	if err != nil {
		return nil, err
	}
	nodes, err := reg.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range nodes {
		if n.State == events.NodeReady && strings.HasPrefix(n.Node, prefix) {
			out = append(out, n.Node)
		}
	}
	slices.Sort(out)
	return out, nil
}

// waitReady waits until n nodes named prefix* are Ready at once, and returns their names and how long it
// waited. It fails the test when p exits first, or when the count of Ready nodes has set no new high for
// stall: how long n agents take to start is the machine's throughput (a 1,500-agent fleet took 71-86 s
// alone on the 2-core test machine, and over 2 minutes beside a CPU-bound neighbour), which benchmarks
// measure, while a start that makes no progress is a failure however fast the machine. It logs the count
// every 15 s.
func waitReady(t testing.TB, b *bus.Bus, p *proc, prefix string, n int, stall time.Duration) ([]string, time.Duration) {
	t.Helper()
	began := time.Now()
	best, bestAt := -1, began
	var last []string
	var lastErr error
	nextLog := began.Add(15 * time.Second)
	for time.Since(bestAt) < stall {
		select {
		case <-p.done:
			t.Fatalf("%s exited with %v before %d nodes were Ready (%d were)\n%s", p.name, p.cmd.ProcessState, n, len(last), tail(p.log, 30))
		default:
		}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		last, lastErr = readyNodes(ctx, b, prefix)
		cancel()
		if lastErr == nil && len(last) >= n {
			return last, time.Since(began)
		}
		if lastErr == nil && len(last) > best {
			best, bestAt = len(last), time.Now()
		}
		if time.Now().After(nextLog) {
			t.Logf("%d of %d nodes %s* Ready after %s (most so far %d; last error %v)", len(last), n, prefix,
				time.Since(began).Round(time.Second), best, lastErr)
			nextLog = nextLog.Add(15 * time.Second)
		}
		time.Sleep(time.Second)
	}
	t.Fatalf("%d of %d nodes %s* Ready after %s, and no more than %d at once for %s (last error %v)\n%s",
		len(last), n, prefix, time.Since(began).Round(time.Second), best, stall, lastErr, tail(p.log, 30))
	return nil, 0
}

// streamEnd returns the last sequence of a stream (the next rollout's events come after it).
func streamEnd(ctx context.Context, b *bus.Bus, stream string) (uint64, error) {
	info, err := b.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	return info.LastSeq, nil
}

// eventsPerNode reads the events stream after seq `after`, on filter, and counts per node the events match
// accepts.
func eventsPerNode(ctx context.Context, b *bus.Bus, filter string, after uint64, match func(events.Event) bool) (map[string]int, error) {
	counts := map[string]int{}
	var bad error
	err := b.Read(ctx, events.EventsStream, filter, func(m bus.StreamMsg) error {
		ev, err := events.DecodeEventMsg(m.Header, m.Data)
		if err != nil {
			bad = fmt.Errorf("event %d on %s: %w", m.Seq, m.Subject, err)
			return bus.StopReading
		}
		if match(ev) {
			counts[ev.Node]++
		}
		return nil
	}, bus.From(after+1))
	return counts, cmpErr(err, bad)
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// gcFinishedPerNode counts the gc.finished events after seq whose result is a rollout's pass: dry run as
// asked, all-unused (the agents' own periodic GC never is).
func gcFinishedPerNode(ctx context.Context, b *bus.Bus, after uint64, dryRun bool) (map[string]int, error) {
	return eventsPerNode(ctx, b, events.Prefix+".evt.*."+events.EntityGC+"."+events.ActionFinished, after, func(ev events.Event) bool {
		var r events.GCResult
		return ev.DecodeData(&r) == nil && r.AllUnused && r.DryRun == dryRun
	})
}

// pullResultsPerNode counts the pull.pulled and pull.failed events after seq that answer rollout's request
// to their node.
func pullResultsPerNode(ctx context.Context, b *bus.Bus, after uint64, rollout string) (map[string]int, error) {
	return eventsPerNode(ctx, b, events.PullEventsFilter, after, func(ev events.Event) bool {
		var r events.PullResult
		if ev.DecodeData(&r) != nil || r.RequestID != fleet.PullRequestID(rollout, ev.Node) {
			return false
		}
		_, action, _, err := events.ParseType(ev.Type)
		return err == nil && (action == events.ActionPulled || action == events.ActionFailed) // not pulling
	})
}

// rolloutRecordsPerNode counts, per node, the claims and outcomes of rollout id in the rollout stream, each
// record that names the node (a record per node, a claim on a range, a group of outcomes), not the first per
// node as LoadRollout keeps.
func rolloutRecordsPerNode(ctx context.Context, b *bus.Bus, id string) (claims, results map[string]int, err error) {
	claims, results = map[string]int{}, map[string]int{}
	prefix := events.Prefix + ".fleet.rollout." + id + "."
	err = b.Read(ctx, events.RolloutStream, events.RolloutFilter(id), func(m bus.StreamMsg) error {
		kind, node, _ := strings.Cut(strings.TrimPrefix(m.Subject, prefix), ".")
		switch kind {
		case events.RolloutClaimKind:
			claims[events.NodeFromToken(node)]++
		case events.RolloutNodeKind:
			results[events.NodeFromToken(node)]++
		case events.RolloutClaimsKind: // a claim on a range: each of its nodes once
			var c events.RolloutClaims
			if err := json.Unmarshal(m.Data, &c); err != nil {
				return fmt.Errorf("claim record %s: %w", m.Subject, err)
			}
			for _, n := range c.Nodes {
				claims[n]++
			}
		case events.RolloutNodesKind: // a group of outcomes: each of its nodes once
			var g events.RolloutNodes
			if err := json.Unmarshal(m.Data, &g); err != nil {
				return fmt.Errorf("outcome record %s: %w", m.Subject, err)
			}
			for _, nr := range g.Nodes {
				results[nr.Node]++
			}
		}
		return nil
	})
	return claims, results, err
}

// onceEach checks that counts holds every node exactly once and nothing else; it returns a description
// of what is wrong (lost: 0, twice: more than 1, unknown: not a node), or "".
func onceEach(nodes []string, counts map[string]int) string {
	var lost, twice, unknown []string
	want := map[string]bool{}
	for _, n := range nodes {
		want[n] = true
		switch c := counts[n]; {
		case c == 0:
			lost = append(lost, n)
		case c > 1:
			twice = append(twice, fmt.Sprintf("%s x%d", n, c))
		}
	}
	for n := range counts {
		if !want[n] {
			unknown = append(unknown, n)
		}
	}
	if len(lost)+len(twice)+len(unknown) == 0 {
		return ""
	}
	short := func(l []string) string {
		slices.Sort(l)
		if len(l) > 10 {
			return fmt.Sprintf("%v ... (%d)", l[:10], len(l))
		}
		return fmt.Sprint(l)
	}
	return fmt.Sprintf("%d nodes lost %s, %d acted on more than once %s, %d not in the plan %s",
		len(lost), short(lost), len(twice), short(twice), len(unknown), short(unknown))
}

// forEachNode calls fn for every node with at most par calls at once and returns the errors joined by
// node (the first 10) with their count.
func forEachNode(nodes []string, par int, fn func(node string) error) error {
	var mu sync.Mutex
	var failed []string
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for _, n := range nodes {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := fn(n); err != nil {
				mu.Lock()
				failed = append(failed, fmt.Sprintf("%s: %v", n, err))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(failed) == 0 {
		return nil
	}
	slices.Sort(failed)
	return fmt.Errorf("%d of %d nodes: %s", len(failed), len(nodes), strings.Join(failed[:min(10, len(failed))], "; "))
}

// procStat is what /proc says a process has cost so far.
type procStat struct {
	CPU time.Duration // user + system
	RSS int64         // resident now, bytes
	HWM int64         // peak resident, bytes
}

// clockTick is USER_HZ, the unit of /proc/<pid>/stat's times: 100 on every Linux architecture Go supports
// (the kernel's ABI fixes it, whatever CONFIG_HZ is).
const clockTick = 10 * time.Millisecond

// readProcStat reads /proc/<pid>/stat (utime, stime) and /proc/<pid>/status (VmRSS, VmHWM).
func readProcStat(pid int) (procStat, error) {
	var st procStat
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return st, err
	}
	// The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return st, fmt.Errorf("/proc/%d/stat: no ')' in %q", pid, s)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return st, fmt.Errorf("/proc/%d/stat: %d fields after the name", pid, len(f))
	}
	// f[0] is field 3 (state): utime is field 14, stime field 15.
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	stm, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return st, fmt.Errorf("/proc/%d/stat: utime %q stime %q", pid, f[11], f[12])
	}
	st.CPU = time.Duration(ut+stm) * clockTick
	fh, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return st, err
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		fs := strings.Fields(v) // "12345 kB"
		if len(fs) != 2 || fs[1] != "kB" {
			return st, fmt.Errorf("/proc/%d/status: %s:%s", pid, k, v)
		}
		kb, err := strconv.ParseInt(fs[0], 10, 64)
		if err != nil {
			return st, fmt.Errorf("/proc/%d/status: %s: %w", pid, k, err)
		}
		if k == "VmRSS" {
			st.RSS = kb << 10
		} else {
			st.HWM = kb << 10
		}
	}
	if st.RSS == 0 || st.HWM == 0 {
		return st, fmt.Errorf("/proc/%d/status: no VmRSS/VmHWM", pid)
	}
	return st, sc.Err()
}

// procSampler samples a set of processes while a measured step runs: CPU used between start and stop, and
// the highest summed RSS seen (each process's VmHWM is its own peak; the sum of peaks of processes that
// peak at different times overstates, so the sum is sampled).
type procSampler struct {
	pids    []int
	start   map[int]procStat
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	peakSum int64
}

func sampleProcs(pids ...int) (*procSampler, error) {
	s := &procSampler{pids: pids, start: map[int]procStat{}, stop: make(chan struct{}), done: make(chan struct{})}
	for _, p := range pids {
		st, err := readProcStat(p)
		if err != nil {
			return nil, err
		}
		s.start[p] = st
	}
	go func() {
		defer close(s.done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			var sum int64
			for _, p := range s.pids {
				if st, err := readProcStat(p); err == nil {
					sum += st.RSS
				}
			}
			s.mu.Lock()
			s.peakSum = max(s.peakSum, sum)
			s.mu.Unlock()
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s, nil
}

// procCost is what a sampled set of processes cost during the step.
type procCost struct {
	CPU     time.Duration // summed CPU time of the processes during the step
	PeakRSS int64         // highest summed RSS sampled
	MaxHWM  int64         // highest single-process peak RSS since start (VmHWM)
}

// Stop ends the sampling; processes that exited meanwhile count with what they used until the last read.
func (s *procSampler) Stop() procCost {
	close(s.stop)
	<-s.done
	var c procCost
	for _, p := range s.pids {
		st, err := readProcStat(p)
		if err != nil {
			continue
		}
		c.CPU += st.CPU - s.start[p].CPU
		c.MaxHWM = max(c.MaxHWM, st.HWM)
	}
	s.mu.Lock()
	c.PeakRSS = s.peakSum
	s.mu.Unlock()
	return c
}
