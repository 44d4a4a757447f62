package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/internal/testport"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestMain removes the binary imagefleetBinary built (about 100 MB in a directory of its own under the
// system's temporary directory) when the package's tests and benchmarks end: every run left one behind.
func TestMain(m *testing.M) {
	code := m.Run()
	if buildOnce.path != "" {
		_ = os.RemoveAll(filepath.Dir(buildOnce.path))
	}
	os.Exit(code)
}

// buildImagefleet builds the imagefleet binary once per test binary run.
var buildOnce struct {
	sync.Once
	path string
	err  error
}

func imagefleetBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "ifl-bin-")
		if err != nil {
			buildOnce.err = err
			return
		}
		buildOnce.path = filepath.Join(dir, "imagefleet")
		cmd := exec.Command("go", "build", "-o", buildOnce.path, "./cmd/imagefleet")
		cmd.Dir = ".."
		if out, err := cmd.CombinedOutput(); err != nil {
			buildOnce.err = fmt.Errorf("go build ./cmd/imagefleet: %v\n%s", err, out)
		}
	})
	if buildOnce.err != nil {
		t.Fatal(buildOnce.err)
	}
	return buildOnce.path
}

// proc is a child process of the test (a NATS server, an agent) with its output in a file.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

func startProc(t testing.TB, name, bin string, args ...string) *proc {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); f.Close(); close(p.done) }()
	t.Cleanup(func() {
		p.stop(syscall.SIGTERM)
		if t.Failed() {
			t.Logf("--- %s log (tail) ---\n%s", name, tail(p.log, 40))
		}
	})
	return p
}

// stop signals the process and waits for it (SIGKILL after 15 s).
func (p *proc) stop(sig syscall.Signal) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// dumpAgent ends a hung agent with SIGQUIT, so the Go runtime writes every goroutine's stack to its log,
// and logs the stacks of its workers one line per t.Logf, with the log lines before them. The cleanup's
// tail of each process is one multi-line t.Logf, whose lines scripts/gotest.sh's failure summary leaves out
// (it keeps a test's own "file_test.go:N:" lines, the last 30): CI's report showed the agents' tails empty.
func dumpAgent(t *testing.T, p *proc) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
	raw, err := os.ReadFile(p.log)
	if err != nil {
		t.Logf("%s log: %v", p.name, err)
		return
	}
	text := string(raw)
	logPart, dump, _ := strings.Cut(text, "SIGQUIT: quit")
	lines := strings.Split(strings.TrimRight(logPart, "\n"), "\n")
	for _, l := range lines[max(0, len(lines)-8):] {
		t.Logf("%s: %s", p.name, l)
	}
	// The goroutines in imagefleet's workers, their frames without the file lines.
	shown := 0
	for _, g := range strings.Split(dump, "\n\n") {
		if !strings.Contains(g, "imagefleet/services/") || shown >= 14 {
			continue
		}
		for _, l := range strings.Split(strings.TrimSpace(g), "\n") {
			if strings.HasPrefix(l, "\t") || shown >= 14 {
				continue
			}
			t.Logf("%s stack: %s", p.name, l)
			shown++
		}
	}
	if dump == "" {
		t.Logf("%s wrote no goroutine dump", p.name)
	}
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func freePort(t testing.TB) int {
	t.Helper()
	return testport.Free(t)
}

// clusterConfigs renders deploy/nats/cluster/server-{1,2,3}.conf for this test: the same files with free
// ports and private store directories.
func clusterConfigs(t testing.TB) (confs []string, urls []string) {
	t.Helper()
	ports := map[string]string{}
	for _, p := range []string{"4222", "4223", "4224", "6222", "6223", "6224", "8222", "8223", "8224"} {
		ports["127.0.0.1:"+p] = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	}
	dir := t.TempDir()
	for i := 1; i <= 3; i++ {
		raw, err := os.ReadFile(filepath.Join("..", "deploy", "nats", "cluster", fmt.Sprintf("server-%d.conf", i)))
		if err != nil {
			t.Fatalf("read the cluster config: %v", err)
		}
		s := string(raw)
		for from, to := range ports {
			s = strings.ReplaceAll(s, from, to)
		}
		s = strings.ReplaceAll(s, fmt.Sprintf("/var/lib/imagefleet/nats-%d", i), filepath.Join(dir, fmt.Sprintf("store-%d", i)))
		if strings.Contains(s, "/var/lib/imagefleet") {
			t.Fatalf("server-%d.conf: store_dir not rewritten", i)
		}
		p := filepath.Join(dir, fmt.Sprintf("server-%d.conf", i))
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		confs = append(confs, p)
		urls = append(urls, "nats://"+ports[fmt.Sprintf("127.0.0.1:%d", 4221+i)])
	}
	return confs, urls
}

// cli runs the imagefleet binary and returns its stdout; a non-zero exit is returned as err with stderr.
func cli(ctx context.Context, bin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		return out.Bytes(), fmt.Errorf("imagefleet %s: %v\nstderr: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.Bytes(), nil
}

func cliJSON(t *testing.T, bin string, v any, args ...string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	out, err := cli(ctx, bin, append(args, "-o", "json")...)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(out, v); err != nil {
		return fmt.Errorf("decode %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// logPullState logs, a line each, where a pre-pull stands on the bus: the work queue, each node's puller
// consumer (pending, in flight, pull requests the server holds, leader), the rollout's claims and results,
// and the pull events of the rollout's requests. It is what a failed pre-pull needs to say which part lost
// the request: the queue, the node's consumer, the puller, or the result's way back.
func logPullState(t *testing.T, b *bus.Bus, rolloutID string, nodes []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	seen := map[string]bool{}
	for _, n := range nodes {
		stream := events.PullStreamOf(n)
		if seen[stream] {
			continue
		}
		seen[stream] = true
		if info, err := b.Stream(ctx, stream); err != nil {
			t.Logf("state: pull queue %s: %v", stream, err)
		} else {
			t.Logf("state: pull queue %s: %d messages, seq %d-%d, leader %q", stream, info.Messages, info.FirstSeq, info.LastSeq, info.Leader)
		}
	}
	for _, n := range nodes {
		st, err := b.Consumer(ctx, events.PullStreamOf(n), events.PullerDurable(n))
		if err != nil {
			t.Logf("state: consumer of %s: %v", n, err)
			continue
		}
		t.Logf("state: consumer of %s: pending %d, in flight %d, redelivered %d, waiting pulls %d, leader %q",
			n, st.NumPending, st.NumAckPending, st.NumRedelivered, st.NumWaiting, st.Leader)
	}
	if _, claims, results, err := fleet.LoadRollout(ctx, b, rolloutID); err != nil {
		t.Logf("state: rollout %s: %v", rolloutID, err)
	} else {
		t.Logf("state: rollout %s: claims %v, results %v", rolloutID, slices.Sorted(maps.Keys(claims)), slices.Sorted(maps.Keys(results)))
	}
	if info, err := b.Stream(ctx, events.EventsStream); err != nil {
		t.Logf("state: events stream: %v", err)
	} else {
		t.Logf("state: events stream: %d messages, last seq %d, leader %q", info.Messages, info.LastSeq, info.Leader)
	}
	err := b.Read(ctx, events.EventsStream, events.PullEventsFilter, func(m bus.StreamMsg) error {
		ev, err := events.DecodeEvent(m.Data)
		var r events.PullResult
		if err == nil && ev.DecodeData(&r) == nil && strings.HasPrefix(r.RequestID, rolloutID+".") {
			t.Logf("state: event %d %s %s at %s: %s %s", m.Seq, ev.Type, ev.Node, ev.Time.Format(time.RFC3339Nano), r.Error, r.Message)
		}
		return nil
	})
	if err != nil {
		t.Logf("state: pull events: %v", err)
	}
}

// TestFleetOnThreeContainerdsAndANATSCluster is the fleet layer for real: three private containerd
// instances, three agents (the built binary: detector, gc, puller, heartbeat), two inventory replicas, and
// a three-server NATS cluster started with `imagefleet bus --config` from deploy/nats/cluster. It runs a
// fleet GC dry run, a fleet pre-pull during which one NATS server is killed, and a real fleet GC, and checks
// that no node is acted on twice, that the inventory follows, and that a stopped node shows as lost.
func TestFleetOnThreeContainerdsAndANATSCluster(t *testing.T) {
	began := time.Now()
	ctx := t.Context()
	bin := imagefleetBinary(t)

	// The NATS cluster, from the deploy configs.
	confs, urls := clusterConfigs(t)
	var servers []*proc
	for i, c := range confs {
		servers = append(servers, startProc(t, fmt.Sprintf("nats-%d", i+1), bin, "bus", "--config", c))
	}
	natsURL := strings.Join(urls, ",")
	b, err := bus.Connect(ctx, natsURL, bus.Options{Name: "fleet-test"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	bustest.Eventually(t, "JetStream cluster with R3 streams", time.Minute, func() error {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return b.EnsureStreams(c, bus.StreamsConfig{Replicas: 3})
	})
	t.Logf("cluster up after %s", time.Since(began).Round(time.Millisecond))

	// The registry, its images, and three containerds holding them.
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	push := func(repoTag string, size int64) string {
		p, err := lab.Push(ctx, reg.Host(), repoTag, size, lab.WithBusybox(bb))
		if err != nil {
			t.Fatal(err)
		}
		return p.Ref
	}
	pause := push("lab/pause:1", 0)
	web := push("lab/web:1", 3*mib)
	tools := push("lab/tools:1", 5*mib)
	cache := push("lab/cache:1", 2*mib)
	prepull := push("lab/prepull:1", 2*mib)

	nodeNames := []string{"node-1", "node-2", "node-3"}
	var ctrds []*lab.Containerd
	for range nodeNames {
		c := lab.StartContainerd(t, lab.Options{SandboxImage: pause, TmpfsSize: "96m"})
		for _, ref := range []string{pause, web, tools, cache} {
			if _, err := c.Client().PullImage(ctx, ref, nil, nil, nil); err != nil {
				t.Fatalf("pull %s: %v", ref, err)
			}
		}
		ctrds = append(ctrds, c)
	}
	lab.RunPod(t, ctrds[2], "web", web) // web is in use on node-3 only
	t.Logf("containerds ready after %s", time.Since(began).Round(time.Millisecond))

	// Three agents and two inventory replicas, every one connected to the whole cluster.
	var agents []*proc
	for i, n := range nodeNames {
		agents = append(agents, startProc(t, "agent-"+n, bin, "agent", "--node", n, "--cri", ctrds[i].Endpoint(), "--nats", natsURL,
			"--workers", "detector,gc,puller,heartbeat", "--stream-replicas", "3", "--data-dir", t.TempDir(),
			"--node-labels", fmt.Sprintf("fleet=lab,zone=z%d", i+1), "--heartbeat-period", "1s", "--image-detect-period", "2s",
			"--minimum-image-ttl-duration", "0s", "--pinned-images", pause, "--image-gc-period", "1h"))
	}
	for i := 1; i <= 2; i++ {
		startProc(t, fmt.Sprintf("inventory-%d", i), bin, "agent", "--node", fmt.Sprintf("fleet-inventory-%d", i), "--nats", natsURL,
			"--workers", "inventory", "--stream-replicas", "3", "--data-dir", t.TempDir())
	}
	common := []string{"--nats", natsURL, "--timeout", "20s"}

	// Registry: three Ready nodes with their labels and runtime.
	threeReady := func() error {
		var nodes []events.NodeStatus
		if err := cliJSON(t, bin, &nodes, append([]string{"fleet", "nodes"}, common...)...); err != nil {
			return err
		}
		var ready []string
		for _, n := range nodes {
			if n.State == events.NodeReady && n.Labels["fleet"] == "lab" && n.RuntimeName == "containerd" && n.ImageFs.CapacityBytes > 0 {
				ready = append(ready, n.Node)
			}
		}
		if !slices.Equal(ready, nodeNames) {
			return fmt.Errorf("ready nodes %v of %+v", ready, nodes)
		}
		return nil
	}
	bustest.Eventually(t, "three Ready nodes", time.Minute, threeReady)

	// The agents run with --stream-replicas 3, so every stream and bucket they create (events, pull queue,
	// detector and puller records, backoff, heartbeats, inventory) is on the three servers from the start:
	// a lost server takes none of them along.
	bustest.Eventually(t, "every stream on three servers", time.Minute, func() error {
		names, err := b.StreamNames(ctx)
		if err != nil {
			return err
		}
		for _, want := range []string{events.EventsStream, events.PullStream, "KV_imagefleet-records", "KV_imagefleet-pull-records"} {
			if !slices.Contains(names, want) {
				return fmt.Errorf("stream %s not created yet (have %v)", want, names)
			}
		}
		for _, n := range names {
			info, err := b.Stream(ctx, n)
			if err != nil {
				return err
			}
			if info.Replicas != 3 {
				return fmt.Errorf("stream %s has %d replicas, want 3", n, info.Replicas)
			}
		}
		return nil
	})

	// Inventory: the detector's events reach it; either replica answers.
	bustest.Eventually(t, "inventory shows tools on three nodes", time.Minute, func() error {
		var rep events.InventoryReply
		if err := cliJSON(t, bin, &rep, append([]string{"fleet", "where", tools}, common...)...); err != nil {
			return err
		}
		if rep.Total != 3 {
			return fmt.Errorf("where %s: %+v", tools, rep)
		}
		return nil
	})
	var images events.InventoryReply
	if err := cliJSON(t, bin, &images, append([]string{"fleet", "images"}, common...)...); err != nil {
		t.Fatal(err)
	}
	if images.Total < 4 || images.TotalBytes <= 0 {
		t.Fatalf("fleet images: %+v", images)
	}

	// 1. A dry run: what GC would remove on each node, and the fleet total; nothing is removed.
	countImages := func(i int) int {
		imgs, err := ctrds[i].Client().ListImages(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(imgs)
	}
	before := []int{countImages(0), countImages(1), countImages(2)}
	var dry events.RolloutResult
	if err := cliJSON(t, bin, &dry, append([]string{"fleet", "gc", "--dry-run", "--all-unused", "--selector", "fleet=lab",
		"--stream-replicas", "3", "--id", "dry-lab"}, common...)...); err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || dry.Succeeded != 3 || !slices.Equal(dry.Batches, []int{1, 2}) || len(dry.Failed) != 0 {
		t.Fatalf("dry run: %+v", dry)
	}
	var wantTotal int64
	for _, nr := range dry.Nodes {
		var names []string
		for _, rm := range nr.GC.Removed {
			names = append(names, rm.RepoTags...)
			wantTotal += rm.Size
		}
		slices.Sort(names)
		want := []string{cache, tools, web}
		if nr.Node == "node-3" {
			want = []string{cache, tools}
		}
		slices.Sort(want)
		if !slices.Equal(names, want) {
			t.Errorf("dry run on %s would remove %v, want %v", nr.Node, names, want)
		}
	}
	if dry.FreedBytes != wantTotal || wantTotal == 0 {
		t.Errorf("dry-run fleet total %d, want %d", dry.FreedBytes, wantTotal)
	}
	for i := range ctrds {
		if n := countImages(i); n != before[i] {
			t.Errorf("dry run changed node-%d: %d images, was %d", i+1, n, before[i])
		}
	}

	// 2. A pre-pull, with one NATS server killed while the second batch pulls.
	reg.SetDelay(400 * time.Millisecond)
	pullOut := make(chan error, 1)
	var pullRes events.RolloutResult
	go func() {
		pullOut <- cliJSON(t, bin, &pullRes, append([]string{"fleet", "pull", prepull, "--selector", "fleet=lab", "--stream-replicas", "3",
			"--id", "pull-lab", "--node-timeout", "90s"}, common...)...)
	}()
	firstNode := make(chan struct{})
	go func() {
		fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		_ = fleet.FollowRollout(fctx, b, "pull-lab", func(ev fleet.RolloutEvent) bool {
			if ev.Node != nil {
				close(firstNode)
				return false
			}
			return true
		})
	}()
	select {
	case <-firstNode:
	case err := <-pullOut:
		t.Fatalf("pull rollout ended before its first node result was seen: %v", err)
	case <-time.After(2 * time.Minute):
		t.Fatal("no node result in the pull rollout")
	}
	servers[0].stop(syscall.SIGKILL)
	t.Logf("killed nats-1 after the first node of the pre-pull (%s in)", time.Since(began).Round(time.Millisecond))
	select {
	case err := <-pullOut:
		if err != nil {
			logPullState(t, b, "pull-lab", nodeNames)
			t.Fatalf("pull rollout with a server killed: %v", err)
		}
	case <-time.After(3 * time.Minute):
		logPullState(t, b, "pull-lab", nodeNames)
		t.Fatal("pull rollout did not finish after a server was killed")
	}
	t.Logf("pull rollout done %s in", time.Since(began).Round(time.Millisecond))
	reg.SetDelay(0)
	if pullRes.Succeeded != 3 || !slices.Equal(pullRes.Batches, []int{1, 2}) || len(pullRes.Failed) != 0 {
		logPullState(t, b, "pull-lab", nodeNames)
		t.Fatalf("pull rollout: %+v", pullRes)
	}
	for i := range ctrds {
		if _, err := ctrds[i].Client().ImageStatus(ctx, prepull); err != nil {
			t.Errorf("node-%d does not hold the pre-pulled image: %v", i+1, err)
		}
	}
	// No node was acted on twice: one claim per node in the rollout, one pull result per node in the events.
	_, claims, results, err := fleet.LoadRollout(ctx, b, "pull-lab")
	if err != nil {
		t.Fatal(err)
	}
	if len(claims) != 3 || len(results) != 3 {
		t.Errorf("pull-lab: %d claims, %d results", len(claims), len(results))
	}
	for _, n := range nodeNames {
		id := fleet.PullRequestID("pull-lab", n)
		count := 0
		if err := b.Read(ctx, events.EventsStream, events.EventSubject(n, events.EntityPull, events.ActionPulled), func(m bus.StreamMsg) error {
			ev, err := events.DecodeEvent(m.Data)
			var r events.PullResult
			if err == nil && ev.DecodeData(&r) == nil && r.RequestID == id {
				count++
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if count != 1 {
			t.Errorf("node %s: %d pull results for %s, want 1", n, count, id)
		}
	}

	// 3. The real GC, on the two servers left, once every node's detector answers again (the workers'
	// own recovery from the lost server is theirs; the rollout needs them able to answer).
	for i, n := range nodeNames {
		asked, fails := time.Now(), 0
		var lastErr error
		for {
			c, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := cli(c, bin, append([]string{"detect", "--node", n}, common...)...)
			cancel()
			if err == nil {
				break
			}
			fails, lastErr = fails+1, err
			if time.Since(asked) > 2*time.Minute {
				dumpAgent(t, agents[i])
				t.Fatalf("detector of %s did not answer for 2m after the server loss (%d tries); the last: %v", n, fails, lastErr)
			}
			time.Sleep(time.Second)
		}
		if fails > 0 {
			t.Logf("detector of %s answered after %s and %d failed tries; the last: %v", n,
				time.Since(asked).Round(time.Millisecond), fails, lastErr)
		}
	}
	t.Logf("node workers answer again %s in", time.Since(began).Round(time.Millisecond))
	// Each stream and bucket elects its own leader after the loss, some after the detectors answer (the
	// node registry's buckets once took over 27 s): the rollout below starts when every one answers.
	bustest.Eventually(t, "every stream answers after the server loss", 2*time.Minute, func() error {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		names, err := b.StreamNames(c)
		if err != nil {
			return err
		}
		for _, n := range names {
			if _, err := b.Stream(c, n); err != nil {
				return fmt.Errorf("stream %s: %w", n, err)
			}
		}
		return nil
	})
	t.Logf("every stream answers again %s in", time.Since(began).Round(time.Millisecond))
	// A node whose heartbeats stopped for 3 periods is Lost and skipped by a rollout (as it should be): the
	// agents connected to the killed server heartbeat again once reconnected and the registry's bucket has a
	// leader (one CI-like run started the GC while nodes 1 and 2 were 8 s stale, and it skipped them).
	bustest.Eventually(t, "three Ready nodes after the server loss", 2*time.Minute, threeReady)
	t.Logf("three nodes Ready again %s in", time.Since(began).Round(time.Millisecond))
	var gcRes events.RolloutResult
	if err := cliJSON(t, bin, &gcRes, append([]string{"fleet", "gc", "--all-unused", "--selector", "fleet=lab", "--stream-replicas", "3",
		"--id", "gc-lab"}, common...)...); err != nil {
		t.Fatal(err)
	}
	if gcRes.DryRun || gcRes.Succeeded != 3 || !slices.Equal(gcRes.Batches, []int{1, 2}) || gcRes.FreedBytes <= 0 {
		t.Fatalf("gc rollout: %+v", gcRes)
	}
	for i := range ctrds {
		for _, ref := range []string{tools, cache, prepull} {
			if _, err := ctrds[i].Client().ImageStatus(ctx, ref); err == nil {
				t.Errorf("node-%d still holds %s after fleet GC", i+1, ref)
			}
		}
		if _, err := ctrds[i].Client().ImageStatus(ctx, pause); err != nil {
			t.Errorf("node-%d lost its pinned pause image: %v", i+1, err)
		}
	}
	if _, err := ctrds[2].Client().ImageStatus(ctx, web); err != nil {
		t.Errorf("node-3 lost its in-use web image: %v", err)
	}
	// Running the same rollout again acts on nobody.
	var again events.RolloutResult
	if err := cliJSON(t, bin, &again, append([]string{"fleet", "gc", "--all-unused", "--selector", "fleet=lab", "--stream-replicas", "3",
		"--id", "gc-lab"}, common...)...); err != nil {
		t.Fatal(err)
	}
	for _, nr := range again.Nodes {
		if !nr.Resumed {
			t.Errorf("rerun of gc-lab acted on %s again", nr.Node)
		}
	}
	// A second operator can replay the rollout.
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	out, err := cli(fctx, bin, append([]string{"fleet", "follow", "gc-lab"}, common...)...)
	cancel()
	if err != nil || !strings.Contains(string(out), "finished: batches [1 2], 3 succeeded, 0 failed") {
		t.Errorf("fleet follow gc-lab: %v\n%s", err, out)
	}

	// The inventory follows the removals.
	bustest.Eventually(t, "inventory shows tools nowhere", time.Minute, func() error {
		var rep events.InventoryReply
		if err := cliJSON(t, bin, &rep, append([]string{"fleet", "where", tools}, common...)...); err != nil {
			return err
		}
		if rep.Total != 0 {
			return fmt.Errorf("where %s: %d placements", tools, rep.Total)
		}
		return nil
	})

	// 4. A node that stops heartbeating is shown as lost, not dropped.
	agents[2].stop(syscall.SIGTERM)
	bustest.Eventually(t, "node-3 lost", 30*time.Second, func() error {
		var nodes []events.NodeStatus
		if err := cliJSON(t, bin, &nodes, append([]string{"fleet", "nodes"}, common...)...); err != nil {
			return err
		}
		states := map[string]string{}
		for _, n := range nodes {
			states[n.Node] = n.State
		}
		if states["node-3"] != events.NodeLost || states["node-1"] != events.NodeReady || states["node-2"] != events.NodeReady {
			return fmt.Errorf("states %v", states)
		}
		return nil
	})
	// Every command above (records, where, images, gc, pull, follow, nodes) connected without
	// --stream-replicas: none may have scaled a stream or bucket down.
	names, err := b.StreamNames(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		info, err := b.Stream(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		if info.Replicas != 3 {
			t.Errorf("stream %s has %d replicas at the end, want 3", n, info.Replicas)
		}
	}
	t.Logf("fleet test done in %s", time.Since(began).Round(time.Millisecond))
}
