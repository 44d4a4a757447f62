package podsource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/imagefleet/imagefleet/events"
)

// APIServerConfig configures the API server pod source of one node.
type APIServerConfig struct {
	// Node is the node name (required): the source watches pods with spec.nodeName=Node.
	Node string
	// REST is the API server's client configuration (required): the agent's --kubeconfig, or the in-cluster
	// config of its pod. The identity needs list and watch on pods (a node's own identity is enough).
	REST *rest.Config
	// ResyncPeriod is how often the source reads the index's listing of its pods again and publishes the
	// differences from the informer's store (default 5m: a listing of every pod of the node; reconnects and
	// the index's gap count trigger one at once).
	ResyncPeriod time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the pod sources' metrics (default prometheus.DefaultRegisterer, which the agent's
	// /metrics serves). Every source of a process shares one set of series.
	Registerer prometheus.Registerer
}

// APIServerSource lists and watches the node's pods as the kubelet's API server source does (a reflector on
// pods with field selector spec.nodeName=<node>, which a node identity is allowed under the Node authorizer)
// and publishes them with kubernetes.io/config.source "api", as the kubelet's pod config annotates them.
// Mirror pods come with them: the index keeps them beside their static pods.
type APIServerSource struct {
	cfg    APIServerConfig
	client kubernetes.Interface
	*feed
}

// NewAPIServerSource validates cfg and builds the client. idx may be nil (the source then starts as if the
// index held none of its pods).
func NewAPIServerSource(cfg APIServerConfig, pub publisher, idx indexReader) (*APIServerSource, error) {
	if cfg.Node == "" {
		return nil, errors.New("apiserver pod source: node name is required")
	}
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, fmt.Errorf("apiserver pod source: %w", err)
	}
	if cfg.ResyncPeriod < 0 {
		return nil, fmt.Errorf("apiserver pod source: resync period %v must not be negative", cfg.ResyncPeriod)
	}
	if cfg.ResyncPeriod == 0 {
		cfg.ResyncPeriod = 5 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if pub == nil {
		return nil, errors.New("apiserver pod source needs a publisher")
	}
	if cfg.REST == nil {
		return nil, errors.New("apiserver pod source: an API server client configuration is required")
	}
	if err := registerMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	rc := rest.CopyConfig(cfg.REST)
	rc.UserAgent = "imagefleet-agent/" + cfg.Node
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("apiserver pod source: %w", err)
	}
	return &APIServerSource{cfg: cfg, client: cs,
		feed: newFeed(cfg.Node, "apiserver", []string{events.ApiserverSource}, true, pub, idx, cfg.Logger)}, nil
}

// fromAPI is the pod as the kubelet's pod config holds it: config.source "api" (mirror pods included: theirs
// says "file", copied from their static pod).
func fromAPI(obj any) (*v1.Pod, bool) {
	p, ok := obj.(*v1.Pod)
	if !ok {
		return nil, false
	}
	p = p.DeepCopy()
	if p.Annotations == nil {
		p.Annotations = map[string]string{}
	}
	p.Annotations[events.ConfigSourceAnnotationKey] = events.ApiserverSource
	p.ManagedFields = nil // server-side apply bookkeeping: nothing the index reads, and most of a pod's bytes
	return p, true
}

// Run lists and watches until ctx ends.
func (s *APIServerSource) Run(ctx context.Context) error {
	s.resume(ctx)
	sel := fields.OneTermEqualSelector("spec.nodeName", s.cfg.Node).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return s.client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return s.client.CoreV1().Pods(metav1.NamespaceAll).Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformerWithOptions(lw, &v1.Pod{}, cache.SharedIndexInformerOptions{})
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		s.unreachable(err)
	}); err != nil {
		return fmt.Errorf("apiserver pod source: %w", err)
	}
	// Handlers run one at a time, in the informer's order, and are level-based: each reads the pod's current
	// state from the informer's store (a notification can be older than the store), so a change is never
	// published with a stale body. A publish error leaves the feed as it was; the next resync publishes the
	// difference again. Until the first sync the handlers stay out: the resync then compares the whole
	// store with the index, deletions while the agent was down included.
	handle := func(what string, err error) {
		if err != nil && ctx.Err() == nil {
			s.log.Warn("pod event not published", "what", what, "err", err)
		}
	}
	var synced atomic.Bool
	store := inf.GetStore()
	level := func(obj any) {
		if !synced.Load() {
			return
		}
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		last, ok := obj.(*v1.Pod)
		if !ok {
			return
		}
		cur, exists, err := store.Get(last)
		if err == nil && exists {
			if p, ok := fromAPI(cur); ok {
				handle("update", s.upsert(ctx, p))
			}
			return
		}
		p, _ := fromAPI(last)
		handle("delete", s.remove(ctx, p.UID, p))
	}
	_, err := inf.AddEventHandlerWithOptions(cache.ResourceEventHandlerFuncs{
		AddFunc:    level,
		UpdateFunc: func(_, obj any) { level(obj) },
		DeleteFunc: level,
	}, cache.HandlerOptions{})
	if err != nil {
		return fmt.Errorf("apiserver pod source: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		inf.RunWithContext(ctx)
	}()
	defer func() { <-done }()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil // ctx ended
	}
	list := func() ([]*v1.Pod, bool) {
		var pods []*v1.Pod
		for _, obj := range store.List() {
			if p, ok := fromAPI(obj); ok {
				pods = append(pods, p)
			}
		}
		return pods, true
	}
	resync := func(fromIndex bool) {
		handle("resync", s.replace(ctx, list, fromIndex))
	}
	// Handlers on before the store is read: a change stored after the read is then handled, one stored
	// before it is in the read (publishing twice is impossible: both compare with the feed under its lock).
	synced.Store(true)
	resync(false)
	s.setUp()
	tick := time.NewTicker(s.cfg.ResyncPeriod)
	defer tick.Stop()
	// The reflector retries a refused connection without a word (it resumes its watch where it was), so
	// the source asks the API server itself: every 15 s while synced (the kubelet renews its lease every
	// 10 s), every 5 s while not.
	probe := time.NewTicker(5 * time.Second)
	defer probe.Stop()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			resync(true)
		case <-probe.C:
			if s.gapsGrew(ctx) {
				s.log.Warn("the pod index lost pod events; reconciling with it")
				resync(true)
			}
			healthy := s.Health() == nil
			if healthy && n%3 != 0 {
				continue
			}
			err := s.reachable(ctx)
			switch {
			case err != nil && ctx.Err() == nil:
				s.unreachable(err)
			case err == nil && !healthy:
				resync(true)
				s.setUp()
			}
		}
	}
}

// unreachable records a list, watch or probe failure (the reflector retries with backoff by itself).
func (s *APIServerSource) unreachable(err error) {
	sourceErrors.WithLabelValues(s.node, s.source, "connect").Inc()
	if s.Health() == nil {
		s.log.Warn("pod source lost the API server; the index keeps its last state", "err", err)
	}
	s.setDown(err)
}

// reachable asks the API server for its version (GET /version: any authenticated identity may).
func (s *APIServerSource) reachable(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := s.client.Discovery().RESTClient().Get().AbsPath("/version").Do(ctx).Raw()
	return err
}
