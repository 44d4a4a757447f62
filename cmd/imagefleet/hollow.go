package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// hollowConfig is `imagefleet hollow`'s configuration: the agent's (every agent flag, passed to each
// node's agent as is) and the hollow nodes'.
type hollowConfig struct {
	Agent agentConfig
	// Nodes is the number of hollow agents; First the index of the first (hollow-<First> ...), so that
	// several processes can share a fleet's names: process k of m runs --first k*N --nodes N --last m*N.
	Nodes, First, Last int
	// ImagesPerNode unused images of ImageSize bytes each are on every node at start.
	ImagesPerNode int
	ImageSize     string
	// PullDelay is how long every pull of a hollow runtime takes (the hollow registry's delay).
	PullDelay time.Duration
	// StartRate is how many agents start per second ("500/s" or "500").
	StartRate string
	// MaxStarting is how many agents may be starting at once: connected or connecting, not yet Ready
	// (default 256).
	MaxStarting int
	// Zones, when > 0, labels node i zone=z<i mod Zones> (besides --node-labels).
	Zones int
	// MemProfile, when set, is where the heap profile goes 10 s after every agent runs (diagnostics).
	MemProfile string
	// PprofAddr, when set, is where the process serves net/http/pprof's /debug/pprof/ (diagnostics).
	PprofAddr string
}

// hollowDefaults are the agent flags whose default differs in `imagefleet hollow` (docs/hollow.md).
var hollowDefaults = []struct{ flag, value string }{
	// The agent's default workers that make sense without a kubelet: no pod index, no removals watcher,
	// no metrics server (one listen address per process), no journal.
	{"workers", "detector,cache,gc,puller,heartbeat"},
	// A journal is a file per node: --no-journal=false puts one under --data-dir/<node>/journal.
	{"no-journal", "true"},
	// The hollow images are all new at start: the kubelet's 2m would make a fleet GC remove nothing for
	// two minutes.
	{"minimum-image-ttl-duration", "0s"},
	// A hollow image filesystem has nothing to statfs: the byte quota is its capacity.
	{"image-fs-capacity", "100Gi"},
}

// hollowHidden are agent flags that mean nothing to hollow nodes (each has its own name and runtime, and
// they connect to --nats).
var hollowHidden = []string{"node", "cri", "embedded-nats", "nats-config", "metrics-addr"}

func (h *hollowConfig) flags(fs *pflag.FlagSet) {
	h.Agent.flags(fs)
	for _, d := range hollowDefaults {
		f := fs.Lookup(d.flag)
		if f == nil {
			panic("hollow: no agent flag --" + d.flag)
		}
		if err := f.Value.Set(d.value); err != nil {
			panic(fmt.Sprintf("hollow: default of --%s: %v", d.flag, err))
		}
		f.DefValue = d.value
		if d.flag == "workers" {
			f.Usage = "comma-separated workers every hollow agent runs (default: " + d.value + "; any agent worker but metrics)"
		}
	}
	for _, name := range hollowHidden {
		_ = fs.MarkHidden(name) // every name is an agent flag: agentConfig.flags binds it
	}
	fs.IntVar(&h.Nodes, "nodes", 0, "number of hollow agents to run (required)")
	fs.IntVar(&h.First, "first", 0, "index of the first node (hollow-<first> ...), for a fleet split over several processes")
	fs.IntVar(&h.Last, "last", 0, "the fleet's node count, which sets the zero-padding of the names (default: first + nodes)")
	fs.IntVar(&h.ImagesPerNode, "images-per-node", 8, "unused images on every hollow node at start")
	fs.StringVar(&h.ImageSize, "image-size", "10Mi", "size of each of those images (bytes or a quantity)")
	fs.DurationVar(&h.PullDelay, "pull-delay", 100*time.Millisecond, "how long every pull takes on a hollow runtime (the hollow registry's delay); the image appears when it ends")
	fs.StringVar(&h.StartRate, "start-rate", "500/s", "agents started per second (N/s or N), so N connections do not arrive at once")
	fs.IntVar(&h.MaxStarting, "max-starting", 256, "agents starting at once at most (connected, not yet Ready): the start goes at the pace the servers answer")
	fs.IntVar(&h.Zones, "zones", 0, "label node i zone=z<i mod zones> for fleet selectors (0: no zone label)")
	fs.StringVar(&h.MemProfile, "mem-profile", "", "write the heap profile to this file 10 s after every agent runs (diagnostics)")
	fs.StringVar(&h.PprofAddr, "pprof-addr", "", "serve Go's /debug/pprof/ on this address, e.g. 127.0.0.1:6061, for CPU profiles of the hollow process during a rollout (diagnostics; no authentication: keep it on loopback)")
	_ = fs.MarkHidden("mem-profile") // bound just above
}

// parseStartRate reads "500/s" or "500": agents per second, > 0.
func parseStartRate(s string) (float64, error) {
	v := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(s), "/s"))
	r, err := strconv.ParseFloat(v, 64)
	if err != nil || r <= 0 {
		return 0, fmt.Errorf("--start-rate %q: want agents per second, N/s or N, above 0", s)
	}
	return r, nil
}

// hollowPlan is a validated hollowConfig.
type hollowPlan struct {
	defs      []workerDef
	names     []string
	imageSize int64
	capacity  int64 // --image-fs-capacity in bytes (0: none)
	rate      float64
}

// plan validates the hollow flags and names the nodes.
func (h *hollowConfig) plan() (*hollowPlan, error) {
	if h.Nodes < 1 {
		return nil, fmt.Errorf("--nodes %d: want at least 1", h.Nodes)
	}
	if h.First < 0 {
		return nil, fmt.Errorf("--first %d: must not be negative", h.First)
	}
	last := h.Last
	if last == 0 {
		last = h.First + h.Nodes
	}
	if last < h.First+h.Nodes {
		return nil, fmt.Errorf("--last %d: below --first + --nodes (%d)", last, h.First+h.Nodes)
	}
	if h.ImagesPerNode < 0 {
		return nil, fmt.Errorf("--images-per-node %d: must not be negative", h.ImagesPerNode)
	}
	if h.Zones < 0 {
		return nil, fmt.Errorf("--zones %d: must not be negative", h.Zones)
	}
	if h.PullDelay < 0 {
		return nil, fmt.Errorf("--pull-delay %v: must not be negative", h.PullDelay)
	}
	q, err := resource.ParseQuantity(strings.TrimSpace(h.ImageSize))
	if err != nil || q.Value() <= 0 {
		return nil, fmt.Errorf("--image-size %q: want a size in bytes above 0 (10Mi, 10485760)", h.ImageSize)
	}
	var capacity int64
	if s := strings.TrimSpace(h.Agent.GCFsQuota); s != "" {
		cq, err := resource.ParseQuantity(s)
		if err != nil {
			return nil, fmt.Errorf("invalid configuration: imageFsCapacity (--image-fs-capacity) %q: %w", s, err)
		}
		capacity = cq.Value()
	}
	r, err := parseStartRate(h.StartRate)
	if err != nil {
		return nil, err
	}
	if h.MaxStarting < 1 {
		return nil, fmt.Errorf("--max-starting %d: want at least 1 agent starting at once", h.MaxStarting)
	}
	if _, err := events.ParseEventVersion(h.Agent.EventVersion); err != nil {
		return nil, fmt.Errorf("--event-version: %w", err)
	}
	defs, err := selectWorkers(h.Agent.Workers)
	if err != nil {
		return nil, err
	}
	for _, d := range defs {
		if d.Name == "metrics" {
			return nil, errors.New("--workers: metrics cannot run in hollow agents (one listen address per process, not per node)")
		}
	}
	p := &hollowPlan{defs: defs, imageSize: q.Value(), capacity: capacity, rate: r, names: make([]string, h.Nodes)}
	for i := range h.Nodes {
		p.names[i] = hollow.NodeName(h.First+i, last)
	}
	return p, nil
}

func newHollowCmd(cl *cli) *cobra.Command {
	var h hollowConfig
	cmd := &cobra.Command{
		Use:   "hollow --nodes N [--images-per-node K]",
		Short: "Run N hollow node agents (real workers, hollow CRI runtimes) for load tests",
		Long: `Run N node agents in this process, as kubemark runs hollow nodes: node hollow-<i> has its own hollow
CRI runtime (an in-memory runtime served over real gRPC CRI, holding --images-per-node unused images), its
own NATS connection to --nats, and the workers of 'imagefleet agent' built by the same code (default:
detector, cache, gc, puller, heartbeat). A fleet GC or pre-pull against them exercises what production does.

Names: hollow-<i> with i zero-padded to 5 digits (hollow-00000 ... hollow-99999; wider past that), so
they sort as their indexes. When all N run it prints "hollow: N agents running" on stderr; SIGINT or
SIGTERM stops them all. Agent flags (periods, GC policy, pull settings) apply to every node.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("log-level") && !cmd.Root().PersistentFlags().Changed("log-level") {
				cl.logLevel = "warn" // ten thousand agents' info lines say nothing an operator reads
				if err := cl.setupLogging(cmd.ErrOrStderr()); err != nil {
					return err
				}
			}
			return runHollow(cmd.Context(), cl, cmd, &h)
		},
	}
	h.flags(cmd.Flags())
	return cmd
}

// hollowFDsPerProcess is the file descriptors a hollow process needs besides its nodes' NATS connections.
const hollowFDsPerProcess = 256

// raiseNoFile makes RLIMIT_NOFILE at least need, raising the hard limit too where the process may (root).
func raiseNoFile(need uint64) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("read RLIMIT_NOFILE: %w", err)
	}
	if lim.Cur >= need {
		return nil
	}
	want := lim
	want.Cur = need
	if want.Max < need {
		want.Max = need
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		return fmt.Errorf("the open file limit is %d (hard %d) and could not be raised to %d: %w", lim.Cur, lim.Max, need, err)
	}
	return nil
}

func runHollow(ctx context.Context, cl *cli, cmd *cobra.Command, h *hollowConfig) error {
	p, err := h.plan()
	if err != nil {
		return err
	}
	// One NATS connection per node; the hollow runtimes' CRI connections are in memory (no descriptor).
	if err := raiseNoFile(uint64(h.Nodes) + hollowFDsPerProcess); err != nil {
		return fmt.Errorf("%d hollow nodes need %d open files (a NATS connection each, plus %d): %w; raise it (ulimit -n, LimitNOFILE=) or run fewer nodes per process (--first, --nodes, --last)",
			h.Nodes, h.Nodes+hollowFDsPerProcess, hollowFDsPerProcess, err)
	}
	base := h.Agent
	stderr := cmd.ErrOrStderr()
	url := cl.natsURL

	// The streams every agent ensures at start, ensured once for the process: what N agents would each do
	// with the same result, without N rounds of stream updates at start.
	setup, err := bus.Connect(ctx, url, cl.busOptions("imagefleet-hollow-setup"))
	if err != nil {
		return err
	}
	err = setup.EnsureStreams(ctx, bus.StreamsConfig{Replicas: base.Replicas})
	setup.Close()
	if err != nil {
		return err
	}

	began := time.Now()
	lim := rate.NewLimiter(rate.Limit(p.rate), 1)
	g, gctx := errgroup.WithContext(ctx)
	if h.PprofAddr != "" {
		if err := servePprof(gctx, g, h.PprofAddr); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "hollow: serving /debug/pprof/ on %s\n", h.PprofAddr)
	}
	var running, restarts atomic.Int64 // agents running; agents restarted after a failure
	allRunning := make(chan struct{})
	// starting holds a slot per agent from its start to its first Ready (or its end), so the start is paced
	// by how fast the servers let agents become Ready, not only by the clock: a start faster than the
	// servers answer made heartbeats time out, their retries load the servers more, and a 10,000-agent
	// start never came up (docs/scale.md).
	starting := make(chan struct{}, h.MaxStarting)
	var launched atomic.Int64
	g.Go(func() error {
		reportStart(gctx, stderr, h.Nodes, &launched, func() int { return len(starting) }, 10*time.Second)
		return nil
	})
	for i, name := range p.names {
		if err := lim.Wait(gctx); err != nil {
			break // stopping: a signal, or an agent failed
		}
		select {
		case starting <- struct{}{}:
		case <-gctx.Done():
		}
		if gctx.Err() != nil {
			break
		}
		launched.Add(1)
		var settle sync.Once
		settled := func() { settle.Do(func() { <-starting }) }
		g.Go(func() error {
			defer settled()
			err := runHollowNode(gctx, cl, cmd, h, p, i, name, func() {
				if running.Add(1) == int64(h.Nodes) {
					close(allRunning)
				}
			}, settled, &restarts)
			if err != nil && gctx.Err() == nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	g.Go(func() error {
		select {
		case <-allRunning:
			fmt.Fprintf(stderr, "hollow: %d agents running (%s to %s, started in %s)\n", h.Nodes, p.names[0], p.names[len(p.names)-1],
				time.Since(began).Round(time.Millisecond))
		case <-gctx.Done():
			return nil
		}
		if h.MemProfile == "" {
			return nil
		}
		select {
		case <-time.After(10 * time.Second):
			return writeMemProfile(h.MemProfile)
		case <-gctx.Done():
			return nil
		}
	})
	err = g.Wait()
	fmt.Fprintf(stderr, "hollow: %d agents stopped (%d restarts after a failure)\n", running.Load(), restarts.Load())
	return err
}

// reportStart prints the start's progress every period until every agent was launched and none is
// starting any more (each Ready, or ended), or ctx ends: how many agents were launched, how many are Ready
// or ended, how many are starting (connected or connecting, not yet Ready), and, when agents are starting
// but none became Ready over a period, that the start is stuck at the servers' pace (the heartbeats'
// warnings say why).
func reportStart(ctx context.Context, w io.Writer, nodes int, launched *atomic.Int64, starting func() int, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	began, lastReady := time.Now(), int64(-1)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, s := launched.Load(), starting()
		ready := n - int64(s)
		if n == int64(nodes) && s == 0 {
			return
		}
		stalled := ""
		if s > 0 && ready == lastReady {
			stalled = fmt.Sprintf("; no agent became Ready in the last %s", period)
		}
		lastReady = ready
		fmt.Fprintf(w, "hollow: %d of %d agents launched, %d Ready or ended, %d starting, after %s%s\n",
			n, nodes, ready, s, time.Since(began).Round(time.Second), stalled)
	}
}

// servePprof serves net/http/pprof's handlers on addr, in g, until ctx ends. A listen error is returned at
// once, before any agent starts.
func servePprof(ctx context.Context, g *errgroup.Group, addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--pprof-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	g.Go(func() error {
		<-ctx.Done()
		return srv.Close()
	})
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("--pprof-addr: %w", err)
		}
		return nil
	})
	return nil
}

// runHollowNode runs hollow node i until ctx ends: its runtime, its connection, its agent. running is
// called once the agent's workers are built and started; restarts counts the agent's restarts.
func runHollowNode(ctx context.Context, cl *cli, cmd *cobra.Command, h *hollowConfig, p *hollowPlan, i int, name string, running, ready func(), restarts *atomic.Int64) error {
	c := h.Agent // a copy per node: the builds read it, and none writes what another node reads
	c.Node = name
	if !c.NoJournal {
		c.DataDir = filepath.Join(c.DataDir, name)
	}
	if h.Zones > 0 {
		zone := "zone=z" + strconv.Itoa((h.First+i)%h.Zones)
		c.NodeLabels = strings.Trim(c.NodeLabels+","+zone, ",")
	}
	log := slog.Default().With("node", name)

	rt := hollow.New(hollow.Options{Name: name, PullLatency: h.PullDelay, Logger: log, Capacity: p.capacity})
	// The heartbeat reports the image filesystem from statfs; a hollow one is its byte quota and the
	// runtime's used bytes.
	c.Heartbeat.Statfs = func(string) (capacity, available int64, err error) {
		capacity, used := rt.FsUsage()
		return capacity, max(capacity-used, 0), nil
	}
	for j := range h.ImagesPerNode {
		ref := fmt.Sprintf("registry.local/hollow/app%d:v1", j)
		if _, err := rt.AddImage(cri.Image{RepoTags: []string{ref}, Size: p.imageSize}); err != nil {
			return err
		}
	}
	var client *cri.Client
	if needsCRI(p.defs) {
		// A real gRPC CRI connection, in memory: ten thousand nodes use no file descriptor for it.
		cc, stop, err := rt.DialWith(context.WithoutCancel(ctx), hollow.DialOptions{BufferSize: 8 << 10,
			Client: cri.Config{Timeout: c.CRITimeout}})
		if err != nil {
			return err
		}
		defer stop()
		client = cc
	}

	// An agent that stops with an error after it ran (a worker failed) is started again with backoff, on
	// the same runtime, as systemd or a DaemonSet restarts a node's agent. So is one whose connection was
	// not had within --timeout: the process's setup connection reached the servers already, so that is a
	// server too busy to accept (10,000 agents connecting to a loaded cluster: one dial timed out and, before
	// this, stopped all 10,000), not a wrong URL. One that never ran for any other reason (its configuration,
	// credentials the server refuses) fails the process.
	ran := false
	delay := time.Second
	for {
		err := runHollowAgent(ctx, cl, cmd, &c, p, client, log, func() {
			if !ran {
				ran = true
				running()
			}
		}, ready)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case ran:
			restarts.Add(1)
			log.Error("hollow agent stopped, restarting", "err", err, "after", delay)
		case bus.IsUnreachable(err):
			log.Warn("hollow agent could not connect, trying again", "err", err, "after", delay)
		default:
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 30*time.Second)
	}
}

// runHollowAgent connects one hollow node's agent, builds its workers and runs them until ctx ends or one
// fails; started is called once they run, ready once they are all Ready.
func runHollowAgent(ctx context.Context, cl *cli, cmd *cobra.Command, c *agentConfig, p *hollowPlan, client *cri.Client, log *slog.Logger, started, ready func()) error {
	opts := cl.busOptions("imagefleet-hollow-" + c.Node)
	opts.Logger = log
	opts.Replicas = c.Replicas
	opts.JournalDir, opts.JournalMaxBytes = c.agentJournal(), c.JournalMaxBytes
	opts.EventVersion = c.EventVersion
	b, err := bus.Connect(ctx, cl.natsURL, opts)
	if err != nil {
		return err
	}
	defer b.Close()
	agent, err := buildAgent(ctx, c, p.defs, agentDeps{Bus: b, CRI: client, Log: log, Changed: cmd.Flags().Changed})
	if err != nil {
		return err
	}
	started()
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-agent.Ready():
			ready()
		case <-actx.Done():
		}
	}()
	return agent.Run(actx)
}
