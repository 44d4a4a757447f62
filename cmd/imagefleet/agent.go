package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// runnable is a worker: Run blocks until ctx ends and returns nil after a clean shutdown.
type runnable interface {
	Run(ctx context.Context) error
}

// agentEnv is what every worker gets from the agent.
type agentEnv struct {
	Node    string
	Bus     *bus.Bus
	CRI     *cri.Client
	DataDir string
	Log     *slog.Logger
}

// workerDef describes one worker the agent can run. Worker files register theirs in init.
type workerDef struct {
	Name string
	// Default: part of the agent's default worker set.
	Default bool
	// NeedsCRI: the worker talks to the container runtime.
	NeedsCRI bool
	// Flags registers the worker's flags on the agent command (kubelet flag names where the kubelet has one).
	Flags func(fs *pflag.FlagSet)
	// Build validates the worker's configuration and builds it.
	Build func(ctx context.Context, env *agentEnv) (runnable, error)
}

var workerDefs []workerDef

func registerWorker(w workerDef) { workerDefs = append(workerDefs, w) }

func init() { registerCommand(newAgentCmd) }

type agentFlags struct {
	node         string
	criEndpoint  string
	embeddedNATS string
	natsConfig   string
	dataDir      string
	workers      string
	criTimeout   time.Duration
	replicas     int
}

func defaultWorkers() string {
	var names []string
	for _, w := range workerDefs {
		if w.Default {
			names = append(names, w.Name)
		}
	}
	return strings.Join(names, ",")
}

func newAgentCmd() *cobra.Command {
	var f agentFlags
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the node workers (detector, cache, gc, puller, pod index, ...)",
		Long: `Run the node workers. By default the agent starts an embedded nats-server on --embedded-nats
(file store under --data-dir); with --nats it connects to an external server or cluster instead.
Each worker can run alone (--workers gc) and be replicated.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAgent(cmd.Context(), cmd, f)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.node, "node", "", "node name (default: the host name)")
	fs.StringVar(&f.criEndpoint, "cri", "unix:///run/containerd/containerd.sock", "CRI endpoint of the container runtime")
	fs.StringVar(&f.embeddedNATS, "embedded-nats", "127.0.0.1:4222", "listen address of the embedded nats-server (used unless --nats is given)")
	fs.StringVar(&f.natsConfig, "nats-config", "", "nats-server config file for the embedded server")
	fs.StringVar(&f.dataDir, "data-dir", defaultDataDir(), "state directory (embedded NATS store, journal)")
	fs.StringVar(&f.workers, "workers", "", "comma-separated workers to run (default: "+defaultWorkers()+")")
	fs.DurationVar(&f.criTimeout, "runtime-request-timeout", 2*time.Minute, "timeout of every CRI call but pulls")
	fs.IntVar(&f.replicas, "stream-replicas", 0, "replicas of the JetStream streams and buckets the agent creates or ensures (3 on a 3-server cluster; 0: 1 for new ones, existing ones keep theirs)")
	for _, w := range workerDefs {
		if w.Flags != nil {
			w.Flags(fs)
		}
	}
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

// selectWorkers resolves --workers against the registry.
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
		i := slices.IndexFunc(workerDefs, func(w workerDef) bool { return w.Name == name })
		if i < 0 {
			var known []string
			for _, w := range workerDefs {
				known = append(known, w.Name)
			}
			return nil, fmt.Errorf("unknown worker %q (known: %s)", name, strings.Join(known, ", "))
		}
		out = append(out, workerDefs[i])
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no workers selected")
	}
	return out, nil
}

func runAgent(ctx context.Context, cmd *cobra.Command, f agentFlags) error {
	if f.node == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("node name: %w", err)
		}
		f.node = strings.ToLower(h)
	}
	if err := events.ValidateNodeName(f.node); err != nil {
		return err
	}
	defs, err := selectWorkers(f.workers)
	if err != nil {
		return err
	}
	log := slog.Default().With("node", f.node)
	env := &agentEnv{Node: f.node, DataDir: f.dataDir, Log: log}

	url := g.natsURL
	if !cmd.Flags().Changed("nats") && !cmd.Root().PersistentFlags().Changed("nats") {
		if err := os.MkdirAll(f.dataDir, 0o750); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		srv, err := bus.StartServer(bus.ServerConfig{Listen: f.embeddedNATS, StoreDir: filepath.Join(f.dataDir, "nats"), ConfigFile: f.natsConfig})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		url = srv.ClientURL()
		log.Info("embedded nats-server started", "url", url)
	}
	opts := busOptions("imagefleet-agent-" + f.node)
	opts.Replicas = f.replicas
	opts.JournalDir, opts.JournalMaxBytes = agentJournal(f.dataDir), journalMaxBytes
	b, err := bus.Connect(ctx, url, opts)
	if err != nil {
		return err
	}
	if opts.JournalDir != "" {
		log.Info("event journal open", "dir", opts.JournalDir)
	}
	defer b.Close()
	env.Bus = b
	if err := b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: f.replicas}); err != nil {
		return err
	}
	if slices.ContainsFunc(defs, func(w workerDef) bool { return w.NeedsCRI }) {
		c, err := cri.Dial(cri.Config{Endpoint: f.criEndpoint, Timeout: f.criTimeout})
		if err != nil {
			return err
		}
		defer func() { _ = c.Close() }()
		env.CRI = c
	}
	var workers []runnable
	var names []string
	for _, d := range defs {
		w, err := d.Build(ctx, env)
		if err != nil {
			return fmt.Errorf("%s: %w", d.Name, err)
		}
		workers = append(workers, w)
		names = append(names, d.Name)
	}
	log.Info("agent started", "workers", strings.Join(names, ","))
	return runAll(ctx, workers, names)
}

// runAll runs workers until ctx ends or one fails; then it stops the rest and waits for them.
func runAll(ctx context.Context, workers []runnable, names []string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(workers))
	for i, w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("%s: %w", names[i], err)
				cancel()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
