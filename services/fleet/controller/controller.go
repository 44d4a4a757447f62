// Package controller is the fleet's Kubernetes controller: it turns ImagePrePull and ImageGC objects
// (api/v1alpha1) into fleet rollouts on the bus (services/fleet's rollout engine, the one the CLI drives)
// and folds their progress back into each object's status, conditions and Events. It runs leader-elected
// in the central Deployment (the agent's "controller" worker); docs/kubernetes-objects.md.
//
// One object is one rollout, its id derived from the object's UID, so a controller that restarts (or a
// new leader) resumes the rollout where the bus recorded it: a node with an outcome is not acted on again,
// and a node claimed without one counts as failed (at most once, as `imagefleet fleet gc --id` resumes). An
// ImagePrePull with completionPolicy KeepNewNodes also runs a one-node rollout for each node that joins the
// fleet after its first one, and removes its readiness taint from the Kubernetes Nodes (newnodes*.go).
// A scheduled ImageGC is one rollout per firing, its id derived from the UID and the firing's time
// (scheduled.go).
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// Config configures the controller.
type Config struct {
	// REST reaches the API server (required).
	REST *rest.Config
	// Namespace holds the leader election Lease (default: $POD_NAMESPACE, else imagefleet).
	Namespace string
	// LeaderElectionID names the Lease (default imagefleet-controller).
	LeaderElectionID string
	// NoLeaderElection runs without a Lease: for a single replica only (tests, a lab).
	NoLeaderElection bool
	// Identity names this replica in the Lease and in the rollout's claims (default: the host name).
	Identity string
	// StreamReplicas of the rollout stream the controller creates (0: the connection's default).
	StreamReplicas int
	// StatusInterval is how often at most a running object's counters are written while nodes end (default
	// 2s). Wave starts, failures (the first 20) and the end are written at once.
	StatusInterval time.Duration
	// PolicyResync is how often the leader delivers the ImageGCPolicy objects again without a change to
	// them, for nodes that joined the registry or changed labels (default 30s).
	PolicyResync time.Duration
	// Registerer takes the controller's metrics (default prometheus.DefaultRegisterer).
	Registerer prometheus.Registerer
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Clock is what a scheduled ImageGC's firings and windows are read on (default the real clock; a test's
	// fake one fires them when stepped).
	Clock clock.WithTickerAndDelayedExecution
}

// Controller runs the reconcilers of ImagePrePull and ImageGC.
type Controller struct {
	cfg   Config
	b     *bus.Bus
	m     *metrics
	ready chan struct{}
	once  sync.Once
}

// New validates cfg.
func New(cfg Config, b *bus.Bus) (*Controller, error) {
	if cfg.REST == nil {
		return nil, errors.New("controller: no API server configuration")
	}
	if b == nil {
		return nil, errors.New("controller: no bus")
	}
	if cfg.Namespace == "" {
		cfg.Namespace = os.Getenv("POD_NAMESPACE")
	}
	if cfg.Namespace == "" {
		cfg.Namespace = "imagefleet"
	}
	if cfg.LeaderElectionID == "" {
		cfg.LeaderElectionID = "imagefleet-controller"
	}
	if cfg.Identity == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("controller: identity: %w", err)
		}
		cfg.Identity = h
	}
	if cfg.StatusInterval < 0 {
		return nil, fmt.Errorf("controller: status interval %v must not be negative", cfg.StatusInterval)
	}
	if cfg.StatusInterval == 0 {
		cfg.StatusInterval = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.PolicyResync <= 0 {
		cfg.PolicyResync = 30 * time.Second
	}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.DefaultRegisterer
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("controller: metrics: %w", err)
	}
	return &Controller{cfg: cfg, b: b, m: m, ready: make(chan struct{})}, nil
}

// Scheme is the scheme the controller's client reads: the core types and imagefleet.io/v1alpha1.
func Scheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Ready is closed once the controller's caches are in sync and its reconcilers are registered (leader or
// not: a standby replica is ready to take over).
func (c *Controller) Ready() <-chan struct{} { return c.ready }

// Run runs the controller until ctx ends. Only the Lease's holder reconciles; a replica that loses the
// Lease stops its rollouts (each resumes under the next holder) and Run returns an error.
func (c *Controller) Run(ctx context.Context) error {
	scheme, err := Scheme()
	if err != nil {
		return err
	}
	log := logr.FromSlogHandler(c.cfg.Logger.With("worker", "controller").Handler())
	UseLogger(c.cfg.Logger.With("worker", "controller"))
	skip := true
	mgr, err := ctrl.NewManager(c.cfg.REST, ctrl.Options{
		Scheme:                        scheme,
		Logger:                        log,
		Metrics:                       metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:        "0",
		LeaderElection:                !c.cfg.NoLeaderElection,
		LeaderElectionID:              c.cfg.LeaderElectionID,
		LeaderElectionNamespace:       c.cfg.Namespace,
		LeaderElectionReleaseOnCancel: true,
		Controller:                    ctrlconfig.Controller{SkipNameValidation: &skip},
		// The readiness taint's reconciler reads Nodes: cached as their names and taints only (readiness.go).
		Cache: cache.Options{ByObject: map[client.Object]cache.ByObject{&corev1.Node{}: {Transform: nodeTaintsOnly}}},
	})
	if err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	rec := mgr.GetEventRecorder("imagefleet-controller")
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The KeepNewNodes ImagePrePulls' new nodes and readiness taint (newnodes*.go, readiness.go).
	keep := newKeeper(ctx, c.cfg, c.b, prePullKind(), mgr.GetClient(), mgr.GetAPIReader(), mgr.GetClient().Status(), rec)
	if err := keep.setupReadiness(mgr); err != nil {
		return fmt.Errorf("controller: readiness taint: %w", err)
	}
	if err := mgr.Add(keep); err != nil {
		return err
	}
	defer keep.stop()
	for _, k := range []kind{prePullKind(), gcKind()} {
		r := &reconciler{kind: k, c: mgr.GetClient(), status: mgr.GetClient().Status(), b: c.b, rec: rec, cfg: c.cfg, log: c.cfg.Logger.With("worker", "controller", "kind", k.name),
			base: ctx, m: c.m, runners: map[string]*runner{}}
		if k.name == "imageprepull" {
			r.keep = keep
		}
		if err := ctrl.NewControllerManagedBy(mgr).For(k.newObject()).Named(k.name).WatchesRawSource(r.wakeSource()).Complete(r); err != nil {
			return fmt.Errorf("controller: %s: %w", k.name, err)
		}
		defer r.stopAll()
	}
	ps := newPolicySync(mgr.GetClient(), c.b, rec, c.cfg, c.m)
	if err := ctrl.NewControllerManagedBy(mgr).For(&v1alpha1.ImageGCPolicy{}).Named("imagegcpolicy").Complete(ps); err != nil {
		return fmt.Errorf("controller: imagegcpolicy: %w", err)
	}
	if err := mgr.Add(ps); err != nil {
		return err
	}
	if err := mgr.Add(copiesRunnable{fleet.NewCopiesArbiter(c.b, fleet.CopiesConfig{Logger: c.cfg.Logger.With("worker", "fleet-copies")})}); err != nil {
		return err
	}
	if err := mgr.Add(readyRunnable{c}); err != nil {
		return err
	}
	if err := mgr.Start(ctx); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	return nil
}

var setLogger sync.Once

// UseLogger makes logger the global logger of controller-runtime's packages (the clients a program makes with
// sigs.k8s.io/controller-runtime/pkg/client log through it), once per process: the first call wins. A
// program that makes such a client calls it first; otherwise controller-runtime prints a warning with a
// stack trace once the client has logged for 30 s with no logger set.
func UseLogger(logger *slog.Logger) {
	setLogger.Do(func() { ctrl.SetLogger(logr.FromSlogHandler(logger.Handler())) })
}

// readyRunnable closes Ready once the manager has synced its caches (it runs on every replica).
type readyRunnable struct{ c *Controller }

func (r readyRunnable) Start(ctx context.Context) error {
	r.c.once.Do(func() { close(r.c.ready) })
	<-ctx.Done()
	return nil
}

func (readyRunnable) NeedLeaderElection() bool { return false }
