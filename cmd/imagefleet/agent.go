package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/socket"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/kevents"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/podsource"
	"github.com/imagefleet/imagefleet/services/puller"
)

// agentConfig is the agent's whole configuration: its own settings, then each worker's Config, which the
// flags (agentConfig.flags and each worker's row in agentWorkers) fill in place. A setting that is not a
// field of a service's Config as the flag gives it (a quantity to parse, an unset-means-defaulting flag)
// has a raw field here and is turned into the Config in the worker's build.
type agentConfig struct {
	Node         string
	CRIEndpoint  string
	HostRoot     string
	EmbeddedNATS string
	NATSConfig   string
	DataDir      string
	Workers      string
	CRITimeout   time.Duration
	Replicas     int
	EventVersion string

	NoJournal       bool
	JournalMaxBytes int64
	MetricsAddr     string

	Detector  detector.Config
	Cache     cache.Config
	GC        gc.Config
	GCFsQuota string // --image-fs-capacity: parsed into GC.CapacityBytes
	Puller    puller.Config
	// SerializePulls and MaxParallelPulls become Puller's pointers only when their flag is given, so that an
	// unset flag keeps the kubelet's defaulting (serialized unless --max-parallel-image-pulls is 2 or more).
	SerializePulls   bool
	MaxParallelPulls int32
	PodIndex         podindex.Config
	Static           podindex.StaticConfig // ManifestPath "": no static pod source
	// PodSource is --pod-source: kubelet, apiserver or none.
	PodSource       string
	KubeletSource   podsource.KubeletConfig
	APIServerSource podsource.APIServerConfig
	Heartbeat       fleet.HeartbeatConfig
	NodeLabels      string // --node-labels: parsed into Heartbeat.Labels
	Inventory       fleet.InventoryConfig
	Controller      controller.Config
	// Kubeconfig is the kubeconfig file of the workers that talk to the API server ("": in-cluster config).
	Kubeconfig string
	KubeEvents kevents.Config
	// KubeletConfig and KubeletCoexistence: the kubelet's configuration file checked against GC's policy.
	KubeletConfig      string
	KubeletCoexistence string

	// NodeStatusReportFrequency is --node-status-report-frequency: converted into Heartbeat.FullEvery.
	NodeStatusReportFrequency time.Duration
}

// agentEnv is what every worker gets from the agent besides the configuration.
type agentEnv struct {
	Node    string
	Bus     *bus.Bus
	CRI     *cri.Client
	DataDir string
	Log     *slog.Logger
	// Workers are the names of the workers this agent runs, in order.
	Workers []string
	// Changed reports whether a flag was given on the command line.
	Changed func(flag string) bool
	// NotReady is nil once every worker of the agent can answer its first request, else why not (/healthz).
	NotReady func() error
}

// flags binds the agent's own flags and every worker's.
func (c *agentConfig) flags(fs *pflag.FlagSet) {
	fs.StringVar(&c.Node, "node", "", "node name (default: the host name)")
	fs.StringVar(&c.CRIEndpoint, "cri", "", "CRI endpoint of the container runtime (unix:///path); empty: find the runtime's socket among the known paths (containerd, k3s, RKE2, k0s, MicroK8s, CRI-O, cri-dockerd; docs/kubernetes.md)")
	fs.StringVar(&c.HostRoot, "host-root", "", "where the host's / is mounted in the agent's pod (such as /host): the CRI socket is searched under it when --cri is empty")
	fs.StringVar(&c.EmbeddedNATS, "embedded-nats", "127.0.0.1:4222", "listen address of the embedded nats-server (used unless --nats is given)")
	fs.StringVar(&c.NATSConfig, "nats-config", "", "nats-server config file for the embedded server")
	fs.StringVar(&c.DataDir, "data-dir", defaultDataDir(), "state directory (embedded NATS store, journal)")
	fs.StringVar(&c.Workers, "workers", "", "comma-separated workers to run (default: "+defaultWorkers()+")")
	fs.DurationVar(&c.CRITimeout, "runtime-request-timeout", 2*time.Minute, "timeout of every CRI call but pulls")
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig file of the workers that talk to the Kubernetes API server (kube-events, --pod-source apiserver); empty: the in-cluster config of the agent's pod")
	fs.IntVar(&c.Replicas, "stream-replicas", 0, "replicas of the JetStream streams and buckets the agent creates or ensures (3 on a 3-server cluster; 0: 1 for new ones, existing ones keep theirs)")
	fs.StringVar(&c.EventVersion, "event-version", events.V1, "type version of the events the agent writes: v1 (the default of this release, read by every release) or v2 (payload-only body, attributes as CloudEvents extensions; set it once every reader runs this release or later: see docs/events.md)")
	for _, w := range agentWorkers {
		if w.Flags != nil {
			w.Flags(fs, c)
		}
	}
}

func newAgentCmd(cl *cli) *cobra.Command {
	var c agentConfig
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the node workers (detector, cache, gc, puller, pod index, ...)",
		Long: `Run the node workers. By default the agent starts an embedded nats-server on --embedded-nats
(file store under --data-dir); with --nats it connects to an external server or cluster instead.
Each worker can run alone (--workers gc) and be replicated.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAgent(cmd.Context(), cl, cmd, c)
		},
	}
	c.flags(cmd.Flags())
	return cmd
}

func defaultDataDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/imagefleet"
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "imagefleet")
	}
	return filepath.Join(os.TempDir(), "imagefleet")
}

// agentJournal is the agent's event journal directory under the data dir ("" with --no-journal).
func (c *agentConfig) agentJournal() string {
	if c.NoJournal {
		return ""
	}
	return filepath.Join(c.DataDir, "journal")
}

func runAgent(ctx context.Context, cl *cli, cmd *cobra.Command, c agentConfig) error {
	if c.Node == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("node name: %w", err)
		}
		c.Node = strings.ToLower(h)
	}
	if err := events.ValidateNodeName(c.Node); err != nil {
		return err
	}
	if _, err := events.ParseEventVersion(c.EventVersion); err != nil {
		return fmt.Errorf("--event-version: %w", err)
	}
	defs, err := selectWorkers(c.Workers)
	if err != nil {
		return err
	}
	log := slog.Default().With("node", c.Node)
	// The runtime socket is found before NATS starts, so an agent that has none exits within the discovery's
	// bound (a few seconds) naming every path it tried, instead of hanging on a socket nobody serves.
	endpoint := c.CRIEndpoint
	if needsCRI(defs) && endpoint == "" {
		found, err := socket.Discover(ctx, socket.Options{Root: c.HostRoot})
		if err != nil {
			return fmt.Errorf("find the CRI socket (--cri names one): %w", err)
		}
		for _, a := range found.Skipped {
			log.Warn("cri socket passed over", "path", a.Path, "runtime", a.Candidate.Runtime, "err", a.Err)
		}
		log.Info("cri socket found", "endpoint", found.Endpoint, "runtime", found.Candidate.Runtime,
			"runtime_name", found.RuntimeName, "runtime_version", found.RuntimeVersion)
		endpoint = found.Endpoint
	}

	url := cl.natsURL
	if !cmd.Flags().Changed("nats") && !cmd.Root().PersistentFlags().Changed("nats") {
		if err := os.MkdirAll(c.DataDir, 0o750); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		srv, err := bus.StartServer(bus.ServerConfig{Listen: c.EmbeddedNATS, StoreDir: filepath.Join(c.DataDir, "nats"), ConfigFile: c.NATSConfig})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		url = srv.ClientURL()
		log.Info("embedded nats-server started", "url", url)
	}
	opts := cl.busOptions("imagefleet-agent-" + c.Node)
	opts.Replicas = c.Replicas
	opts.JournalDir, opts.JournalMaxBytes = c.agentJournal(), c.JournalMaxBytes
	opts.EventVersion = c.EventVersion
	b, err := bus.Connect(ctx, url, opts)
	if err != nil {
		return err
	}
	if opts.JournalDir != "" {
		log.Info("event journal open", "dir", opts.JournalDir)
	}
	defer b.Close()
	if err := b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: c.Replicas}); err != nil {
		return err
	}
	var rt *cri.Client
	if needsCRI(defs) {
		if rt, err = cri.Dial(cri.Config{Endpoint: endpoint, Timeout: c.CRITimeout}); err != nil {
			return err
		}
		defer func() { _ = rt.Close() }()
	}
	agent, err := buildAgent(ctx, &c, defs, agentDeps{Bus: b, CRI: rt, Log: log, Changed: cmd.Flags().Changed})
	if err != nil {
		return err
	}
	// The line says ready only once every worker is: an operator (or a script) that acts on it finds each
	// query and command answered.
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- agent.Run(ctx) }()
	select {
	case <-agent.Ready():
		log.Info("agent ready", "workers", strings.Join(agent.names(), ","), "after", time.Since(start).Round(time.Millisecond))
	case err := <-errc:
		return err
	}
	return <-errc
}

// agentDeps is what one agent is built from besides its configuration: its NATS connection and its
// container runtime. `imagefleet agent` dials them; `imagefleet hollow` gives each of its nodes its own.
type agentDeps struct {
	Bus *bus.Bus
	CRI *cri.Client // nil when no worker of the agent needs CRI
	Log *slog.Logger
	// Changed reports whether a flag was given on the command line.
	Changed func(flag string) bool
}

// buildAgent builds the workers defs names (in their order) of the node c.Node: the one path from a
// configuration to a running node agent, for `imagefleet agent` and every node of `imagefleet hollow`.
func buildAgent(ctx context.Context, c *agentConfig, defs []workerDef, d agentDeps) (*agentRun, error) {
	a := &agentRun{defs: defs, workers: make([]runnable, len(defs)), ready: make(chan struct{})}
	env := &agentEnv{Node: c.Node, Bus: d.Bus, CRI: d.CRI, DataDir: c.DataDir, Log: d.Log, Changed: d.Changed,
		NotReady: a.notReady}
	for _, w := range defs {
		env.Workers = append(env.Workers, w.Name)
	}
	for i, w := range defs {
		var err error
		if a.workers[i], err = w.Build(ctx, c, env); err != nil {
			return nil, fmt.Errorf("%s: %w", w.Name, err)
		}
		if wrapWorker != nil {
			a.workers[i] = wrapWorker(c.Node, w.Name, a.workers[i])
		}
	}
	return a, nil
}

// agentVersion is the module version the binary was built from ("dev" for a local build).
func agentVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
