package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/kubeletcfg"
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
	"github.com/imagefleet/imagefleet/services/removals"
)

// runnable is a worker: Run blocks until ctx ends and returns nil after a clean shutdown.
type runnable interface {
	Run(ctx context.Context) error
}

// readier is a worker that says when it can do its job: Ready closes once its subscriptions and consumers
// are at the server, and for some once a first piece of work is done (the pod index caught up, the
// detector's first detection, the heartbeat's first write, a pod source's first sync, the inventory's index
// loaded). A worker without Ready counts as ready as soon as it runs: the agent cannot tell more.
type readier interface {
	Ready() <-chan struct{}
}

// readySignals are w's Ready channel, or those of each worker of a group.
func readySignals(w runnable) []<-chan struct{} {
	switch w := w.(type) {
	case group:
		var out []<-chan struct{}
		for _, m := range w {
			out = append(out, readySignals(m)...)
		}
		return out
	case readier:
		return []<-chan struct{}{w.Ready()}
	}
	return nil
}

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

// workerDef is one row of agentWorkers.
type workerDef struct {
	Name string
	// Default: part of the agent's default worker set.
	Default bool
	// NeedsCRI: the worker talks to the container runtime.
	NeedsCRI bool
	// Flags binds the worker's flags to its fields of the agent's configuration (kubelet flag names where the
	// kubelet has the setting). The flags exist whatever --workers selects.
	Flags func(fs *pflag.FlagSet, c *agentConfig)
	// Build validates the worker's configuration and builds it; it runs only for the selected workers.
	Build func(ctx context.Context, c *agentConfig, env *agentEnv) (runnable, error)
}

// agentWorkers is the one table of the agent's workers, in the order they are built and started.
//
// To add a worker: add a row here. Its Config goes into agentConfig as a field (a service's Config
// composed as is), its flags bind to that field in the row's Flags, and Build turns the field into the
// worker (filling in Node and Logger from env). Nothing else changes: --workers, the default worker list,
// the demo and the heartbeat's worker list all read this table.
//
// To add a flag: bind it in the Flags of the worker that uses it (a field of that worker's Config where
// one fits, or a raw field of agentConfig converted in Build); a flag of the agent itself goes into
// agentConfig.flags. Flag names are the kubelet's where the kubelet has the setting.
var agentWorkers = []workerDef{
	{
		// The journal is opened by the agent with its connection, before any worker publishes, whatever
		// --workers says. "journal" stays a worker name only so that lists naming it keep working.
		Name: "journal", Default: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.BoolVar(&c.NoJournal, "no-journal", false, "do not journal events locally before publishing them")
			fs.Int64Var(&c.JournalMaxBytes, "journal-max-bytes", 64<<20, "size bound of the event journal file under --data-dir/journal (rotated past it)")
		},
		Build: func(context.Context, *agentConfig, *agentEnv) (runnable, error) { return idle{}, nil },
	},
	{
		Name: "metrics", Default: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "serve Prometheus metrics on host:port at /metrics (\"\": off; e.g. 127.0.0.1:9464)")
		},
		Build: buildMetrics,
	},
	{
		Name: "detector", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.DurationVar(&c.Detector.Period, "image-detect-period", 5*time.Minute, "how often the detector refreshes image records")
		},
		Build: func(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
			cfg := c.Detector
			cfg.Node, cfg.Logger = env.Node, env.Log
			return detector.New(cfg, env.CRI, env.Bus)
		},
	},
	{
		Name: "cache", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.DurationVar(&c.Cache.Period, "image-cache-period", 30*time.Second, "how often the image list cache refreshes")
		},
		Build: func(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
			cfg := c.Cache
			cfg.Node, cfg.Logger = env.Node, env.Log
			return cache.New(cfg, env.CRI, env.Bus)
		},
	},
	{
		Name: "heartbeat", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.StringVar(&c.NodeLabels, "node-labels", "", "labels of this node for fleet selectors, k=v,k2=v2")
			fs.DurationVar(&c.Heartbeat.Period, "heartbeat-period", 10*time.Second, "how often the node announces itself to the fleet registry")
			fs.Float64Var(&c.Heartbeat.MaxRate, "heartbeat-max-rate", fleet.DefaultHeartbeatMaxRate,
				"heartbeats per second the fleet's registry takes before its nodes stretch their period (never below --heartbeat-period, never above a third of the registry bucket's TTL); 0 keeps the period fixed")
			fs.DurationVar(&c.NodeStatusReportFrequency, "node-status-report-frequency", 5*time.Minute,
				"how often the node's full record (labels, runtime, workers, image filesystem) is written to the registry even when unchanged, as the kubelet's nodeStatusReportFrequency; rounded up to whole --heartbeat-period periods (a heartbeat in between writes only the node's name and time, a change is written at once)")
		},
		Build: func(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
			cfg, err := heartbeatConfig(c, env)
			if err != nil {
				return nil, err
			}
			return fleet.NewHeartbeat(cfg, env.CRI, env.Bus)
		},
	},
	{
		// Images removed by another remover (the kubelet's GC or eviction manager, crictl rmi): counted,
		// logged and reported as a node Warning (ImageRemovedExternally).
		Name: "removals", Default: true,
		Build: func(_ context.Context, _ *agentConfig, env *agentEnv) (runnable, error) {
			return removals.New(removals.Config{Node: env.Node, Logger: env.Log}, env.Bus)
		},
	},
	{
		Name: "kube-events", Default: false,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.StringVar(&c.KubeEvents.Component, "kube-events-component", kevents.DefaultComponent, "source component of the Kubernetes Events the kube-events bridge posts (kubelet: described as the kubelet's own)")
		},
		Build: buildKubeEvents,
	},
	{
		Name: "inventory", Default: false,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.IntVar(&c.Inventory.Concurrency, "inventory-concurrency", 0, "image events one inventory replica applies at once (0: 32 on the shared durable; 256 over the 16 partitions, 16 each)")
			fs.BoolVar(&c.Inventory.Partitioned, "inventory-partitioned", false, "consume image events through the 16 partition durables of IMAGEFLEET_INVENTORY instead of the shared durable fleet-inventory (docs/operations.md)")
		},
		Build: func(ctx context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
			cfg := c.Inventory
			cfg.Replica, cfg.Logger = env.Node, env.Log
			return fleet.NewInventory(ctx, cfg, env.Bus)
		},
	},
	{
		// The Kubernetes controller of ImagePrePull and ImageGC objects (leader-elected; the central
		// Deployment runs it): docs/kubernetes-objects.md.
		Name: "controller", Default: false,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.StringVar(&c.Controller.Namespace, "controller-namespace", "", "namespace of the controller's leader election Lease (default: $POD_NAMESPACE, else imagefleet)")
			fs.BoolVar(&c.Controller.NoLeaderElection, "controller-no-leader-election", false, "run the controller without a Lease (one replica only: a lab, a test)")
		},
		Build: buildController,
	},
	{
		Name: "gc", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			d := gc.DefaultPolicy()
			fs.IntVar(&c.GC.Policy.HighThresholdPercent, "image-gc-high-threshold", d.HighThresholdPercent, "percent of image filesystem usage at or above which image GC runs")
			fs.IntVar(&c.GC.Policy.LowThresholdPercent, "image-gc-low-threshold", d.LowThresholdPercent, "percent of image filesystem usage image GC frees down to")
			fs.DurationVar(&c.GC.Policy.MinAge, "minimum-image-ttl-duration", d.MinAge, "minimum age of an image (since first detected) before GC may remove it")
			fs.DurationVar(&c.GC.Policy.MaxAge, "image-maximum-gc-age", d.MaxAge, "remove unused images older than this whatever the usage (0s: disabled)")
			fs.StringVar(&c.GCFsQuota, "image-fs-capacity", "", "byte quota for images (bytes, or a quantity like 10Gi): capacity = this, used = sum of image sizes (default: statfs of the image filesystem)")
			fs.StringSliceVar(&c.GC.PinnedImages, "pinned-images", nil, "references and globs of images GC never removes (REF,GLOB,...; e.g. busybox,*/pause:*)")
			fs.DurationVar(&c.GC.Period, "image-gc-period", 5*time.Minute, "period of the image GC loop")
			fs.DurationVar(&c.GC.CheckPeriod, "image-gc-check-period", 10*time.Second, "period of the image filesystem usage check that starts image GC between periods when usage reaches the high threshold")
			fs.IntVar(&c.GC.RemovalParallelism, "image-gc-removal-parallelism", 16, "images removed at once (1: one by one, as the kubelet)")
			fs.StringVar(&c.KubeletConfig, "kubelet-config", "", "the node kubelet's KubeletConfiguration file: read at start, with a warning naming each setting that would fight imagefleet's GC (docs/kubernetes.md)")
			fs.StringVar(&c.KubeletCoexistence, "kubelet-coexistence", kubeletcfg.FirstResponder, "how imagefleet lives beside the kubelet's image GC: first-responder (its thresholds below the kubelet's) or takeover (the kubelet's image GC off)")
		},
		Build: func(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
			cfg, err := gcConfig(c, env.Node)
			if err != nil {
				return nil, err
			}
			cfg.Logger = env.Log
			if err := warnKubeletConfig(c, cfg, env.Log); err != nil {
				return nil, err
			}
			return gc.New(cfg, gc.Deps{Runtime: env.CRI, Bus: env.Bus})
		},
	},
	{
		Name: "podindex", Default: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.StringVar(&c.Static.ManifestPath, "pod-manifest-path", "", "directory (or file) of static pod manifests; empty: no static pod source")
			fs.DurationVar(&c.Static.ResyncPeriod, "file-check-frequency", 20*time.Second, "how often the static pod manifests are read again besides file notifications")
			fs.DurationVar(&c.PodIndex.FlushInterval, "pod-index-flush-interval", 5*time.Second, "how often the pod index writes its snapshot while it keeps up with its events")
			fs.StringVar(&c.PodSource, "pod-source", "none", "where the node's pods come from: kubelet (its Pods API socket), apiserver (a watch of spec.nodeName=<node>, with --kubeconfig), none")
			fs.StringVar(&c.KubeletSource.Socket, "kubelet-pods-socket", podsource.DefaultPodsSocket, "the kubelet's Pods API socket (--pod-source kubelet)")
		},
		Build: buildPodIndex,
	},
	{
		Name: "puller", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet, c *agentConfig) {
			fs.BoolVar(&c.SerializePulls, "serialize-image-pulls", true, "pull one image at a time (default true unless --max-parallel-image-pulls is 2 or more)")
			fs.Int32Var(&c.MaxParallelPulls, "max-parallel-image-pulls", 0, "the node's pull tokens in parallel mode, enforced by the NATS server across every puller replica (unset: no limit)")
			fs.Float64Var(&c.Puller.RegistryPullQPS, "registry-qps", 5, "registry pulls per second (token bucket, no waiting: over it a pull fails with \"pull QPS exceeded\"); 0: unlimited")
			fs.IntVar(&c.Puller.RegistryBurst, "registry-burst", 10, "burst of the registry pull token bucket")
			fs.StringVar(&c.Puller.PullSecretsDir, "pull-secrets-dir", "", "directory of Secret manifests (JSON or YAML, kubernetes.io/dockerconfigjson) the pods' image pull secrets are read from, by namespace and name")
			fs.StringVar(&c.Puller.NodeKeyring, "node-keyring", "", "docker config.json with the node's registry credentials (usable by every pod)")
			fs.StringVar(&c.Puller.CredentialVerificationPolicy, "image-pull-credentials-verification-policy", puller.NeverVerifyPreloadedImages, "KEP-2535: NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages or AlwaysVerify")
			fs.StringSliceVar(&c.Puller.PreloadedImagesAllowlist, "preloaded-images-verification-allowlist", nil, "repositories (or host/path/*) never verified under NeverVerifyAllowlistedImages")
			fs.DurationVar(&c.Puller.AckWait, "pull-ack-wait", 30*time.Second, "how long a silent puller keeps a request before another replica gets it")
			fs.BoolVar(&c.Puller.PullOnPodAdd, "pull-on-pod-add", false, "enqueue a pull for each image of a pod added on this node (pod.added events), with the container's pull policy and the pod's pull secrets")
		},
		Build: buildPuller,
	},
}

// gcConfig builds the executor's Config from the flags.
func gcConfig(c *agentConfig, node string) (gc.Config, error) {
	cfg := c.GC
	cfg.Node = node
	if s := strings.TrimSpace(c.GCFsQuota); s != "" {
		q, err := resource.ParseQuantity(s)
		if err != nil {
			return gc.Config{}, fmt.Errorf("invalid configuration: imageFsCapacity (--image-fs-capacity) %q: %w", s, err)
		}
		cfg.CapacityBytes = q.Value()
	}
	if cfg.RemovalParallelism < 1 {
		return gc.Config{}, fmt.Errorf("invalid configuration: imageGCRemovalParallelism (--image-gc-removal-parallelism) %v must be a positive number", cfg.RemovalParallelism)
	}
	if cfg.Period <= 0 {
		return gc.Config{}, fmt.Errorf("invalid configuration: imageGCPeriod (--image-gc-period) %v must be positive", cfg.Period)
	}
	if cfg.CheckPeriod <= 0 {
		return gc.Config{}, fmt.Errorf("invalid configuration: imageGCCheckPeriod (--image-gc-check-period) %v must be positive", cfg.CheckPeriod)
	}
	if err := cfg.Validate(); err != nil {
		return gc.Config{}, err
	}
	return cfg, nil
}

// buildPuller builds the puller: an unset --serialize-image-pulls or --max-parallel-image-pulls keeps the
// kubelet's defaulting (serialized unless --max-parallel-image-pulls is 2 or more).
func buildPuller(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
	cfg := c.Puller
	cfg.Node, cfg.Logger, cfg.Registerer = env.Node, env.Log, prometheus.DefaultRegisterer
	// Room before a pull: the GC executor's high threshold (--image-gc-high-threshold).
	cfg.ImageGCHighThresholdPercent = c.GC.Policy.HighThresholdPercent
	if env.Changed("serialize-image-pulls") {
		v := c.SerializePulls
		cfg.SerializeImagePulls = &v
	}
	if env.Changed("max-parallel-image-pulls") {
		v := c.MaxParallelPulls
		cfg.MaxParallelImagePulls = &v
	}
	return puller.New(cfg, env.CRI, env.Bus)
}

// buildPodIndex builds the pod index and beside it, with --pod-manifest-path, the static pod source, and
// with --pod-source, the kubelet's or the API server's.
func buildPodIndex(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
	cfg := c.PodIndex
	cfg.Node, cfg.Logger = env.Node, env.Log
	ix, err := podindex.New(cfg, env.Bus)
	if err != nil {
		return nil, err
	}
	registerHealth("pod index", ix.Health)
	workers := group{ix}
	if c.Static.ManifestPath != "" {
		if c.PodSource == "kubelet" {
			// Both would own the config source "file": the Pods API serves the kubelet's static pods.
			return nil, errors.New("--pod-manifest-path and --pod-source kubelet exclude each other: the kubelet's Pods API serves its static pods")
		}
		scfg := c.Static
		scfg.Node, scfg.Logger = env.Node, env.Log
		src, err := podindex.NewStaticSource(scfg, env.Bus, env.Bus)
		if err != nil {
			return nil, err
		}
		workers = append(workers, src)
	}
	switch c.PodSource {
	case "none", "":
	case "kubelet":
		kcfg := c.KubeletSource
		kcfg.Node, kcfg.Logger = env.Node, env.Log
		src, err := podsource.NewKubeletSource(kcfg, env.Bus, env.Bus)
		if err != nil {
			return nil, err
		}
		registerHealth("pod source kubelet", src.Health)
		workers = append(workers, src)
	case "apiserver":
		rc, err := kubeRESTConfig(c.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--pod-source apiserver: %w", err)
		}
		acfg := c.APIServerSource
		acfg.Node, acfg.Logger, acfg.REST = env.Node, env.Log, rc
		src, err := podsource.NewAPIServerSource(acfg, env.Bus, env.Bus)
		if err != nil {
			return nil, err
		}
		registerHealth("pod source apiserver", src.Health)
		workers = append(workers, src)
	default:
		return nil, fmt.Errorf("--pod-source %q: want kubelet, apiserver or none", c.PodSource)
	}
	if len(workers) == 1 {
		return ix, nil
	}
	return workers, nil
}

// group runs runnables until ctx ends or one fails.
type group []runnable

func (r group) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, w := range r {
		g.Go(func() error { return w.Run(ctx) })
	}
	return g.Wait()
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

func defaultWorkers() string {
	var names []string
	for _, w := range agentWorkers {
		if w.Default {
			names = append(names, w.Name)
		}
	}
	return strings.Join(names, ",")
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

// selectWorkers resolves --workers against agentWorkers.
func selectWorkers(list string) ([]workerDef, error) {
	if list == "" {
		list = defaultWorkers()
	}
	var out []workerDef
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		i := slices.IndexFunc(agentWorkers, func(w workerDef) bool { return w.Name == name })
		if i < 0 {
			var known []string
			for _, w := range agentWorkers {
				known = append(known, w.Name)
			}
			return nil, fmt.Errorf("unknown worker %q (known: %s)", name, strings.Join(known, ", "))
		}
		out = append(out, agentWorkers[i])
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no workers selected")
	}
	return out, nil
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

// needsCRI reports whether one of defs talks to the container runtime.
func needsCRI(defs []workerDef) bool {
	return slices.ContainsFunc(defs, func(w workerDef) bool { return w.NeedsCRI })
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

// heartbeatConfig turns the heartbeat's flags into its Config: --node-labels parsed, and
// --node-status-report-frequency converted into heartbeats (FullEvery), rounded up so that an unchanged full
// record is written at most that often apart (at least every heartbeat).
func heartbeatConfig(c *agentConfig, env *agentEnv) (fleet.HeartbeatConfig, error) {
	labels, err := fleet.ParseLabels(c.NodeLabels)
	if err != nil {
		return fleet.HeartbeatConfig{}, err
	}
	report := c.NodeStatusReportFrequency
	if report <= 0 {
		return fleet.HeartbeatConfig{}, fmt.Errorf("invalid configuration: nodeStatusReportFrequency (--node-status-report-frequency) %v: must be above 0", report)
	}
	cfg := c.Heartbeat
	switch {
	case cfg.MaxRate < 0:
		return fleet.HeartbeatConfig{}, fmt.Errorf("invalid configuration: --heartbeat-max-rate %v: must not be negative (0 keeps the period fixed)", cfg.MaxRate)
	case cfg.MaxRate == 0:
		cfg.MaxRate = -1 // HeartbeatConfig's "never stretch"; its 0 is the default rate
	}
	period := cfg.Period
	if period <= 0 {
		period = fleet.DefaultHeartbeatPeriod // NewHeartbeat's default; a negative one it rejects
	}
	cfg.FullEvery = int(min((report-1)/period+1, math.MaxInt32))
	cfg.Node, cfg.Labels, cfg.AgentVersion, cfg.Workers, cfg.Logger = env.Node, labels, agentVersion(), env.Workers, env.Log
	return cfg, nil
}

// wrapWorker, set only by tests, wraps each worker buildAgent builds: how a test makes one node's real
// worker fail after it started (TestHollowRestartsAFailedAgent), with no fault flag in the shipped command.
var wrapWorker func(node, worker string, w runnable) runnable

// agentRun is one node agent's built workers.
type agentRun struct {
	defs    []workerDef
	workers []runnable
	// ready is closed once every worker's Ready has closed (Run).
	ready     chan struct{}
	readyOnce sync.Once
}

// Ready is closed once every worker can answer its first request.
func (a *agentRun) Ready() <-chan struct{} { return a.ready }

// notReady is nil once every worker is ready, else an error naming those that are not yet.
func (a *agentRun) notReady() error {
	if closed(a.ready) {
		return nil
	}
	var names []string
	for i, w := range a.workers {
		if slices.ContainsFunc(readySignals(w), func(c <-chan struct{}) bool { return !closed(c) }) {
			names = append(names, a.defs[i].Name)
		}
	}
	if len(names) == 0 {
		return errors.New("agent starting")
	}
	return fmt.Errorf("agent starting: not ready yet: %s", strings.Join(names, ", "))
}

// closed reports whether c is closed.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func (a *agentRun) names() []string {
	out := make([]string, len(a.defs))
	for i, d := range a.defs {
		out[i] = d.Name
	}
	return out
}

// Run runs every worker until ctx ends or one fails (which stops the others), and closes Ready once every
// worker is ready.
func (a *agentRun) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	for i, w := range a.workers {
		g.Go(func() error {
			if err := w.Run(gctx); err != nil {
				return fmt.Errorf("%s: %w", a.defs[i].Name, err)
			}
			return nil
		})
	}
	g.Go(func() error {
		for _, w := range a.workers {
			for _, c := range readySignals(w) {
				select {
				case <-c:
				case <-gctx.Done():
					return nil
				}
			}
		}
		a.readyOnce.Do(func() { close(a.ready) })
		return nil
	})
	return g.Wait()
}

// idle is a worker with nothing to run: its work happens in the bus (the journal) or in Build.
type idle struct{}

func (idle) Run(ctx context.Context) error { <-ctx.Done(); return nil }

// agentVersion is the module version the binary was built from ("dev" for a local build).
func agentVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
