package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/imagefleet/imagefleet/internal/kubeletcfg"
	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/kevents"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/podsource"
	"github.com/imagefleet/imagefleet/services/puller"
	"github.com/imagefleet/imagefleet/services/removals"
)

// The agent's workers: the table of what each needs and how it is built from the agent's flags.

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

func defaultWorkers() string {
	var names []string
	for _, w := range agentWorkers {
		if w.Default {
			names = append(names, w.Name)
		}
	}
	return strings.Join(names, ",")
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

// needsCRI reports whether one of defs talks to the container runtime.
func needsCRI(defs []workerDef) bool {
	return slices.ContainsFunc(defs, func(w workerDef) bool { return w.NeedsCRI })
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
