package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/services/puller"
)

// buildMetrics builds the metrics server of --metrics-addr (an idle worker when it is empty).
func buildMetrics(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
	if c.MetricsAddr == "" {
		return idle{}, nil
	}
	return newMetricsServer(c.MetricsAddr, env.Bus, env.Node, env.NotReady, prometheus.DefaultRegisterer, prometheus.DefaultGatherer)
}

// metricsServer serves the default gatherer: the kubelet metrics the workers register, the bus's pipeline
// metrics, and the node's pull queue (read from its pull consumer at each scrape); and /healthz, the agent's
// readiness: 503 with the reason until every worker can answer its first request, while NATS is
// disconnected, and while a worker's own health check fails.
type metricsServer struct {
	ln  net.Listener
	srv *http.Server
	reg prometheus.Registerer
	col prometheus.Collector
}

// notReady (nil: always ready) is nil once the agent's workers are ready, else why not.
func newMetricsServer(addr string, b *bus.Bus, node string, notReady func() error, reg prometheus.Registerer, g prometheus.Gatherer) (*metricsServer, error) {
	if err := bus.RegisterMetrics(reg); err != nil {
		return nil, err
	}
	col := puller.NewQueueCollector(b, []string{node})
	if err := reg.Register(col); err != nil {
		return nil, fmt.Errorf("register pull queue metrics: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		reg.Unregister(col)
		return nil, fmt.Errorf("metrics listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !b.Connected() {
			http.Error(w, "nats disconnected", http.StatusServiceUnavailable)
			return
		}
		if notReady != nil {
			if err := notReady(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		if err := checkHealth(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return &metricsServer{ln: ln, reg: reg, col: col,
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}}, nil
}

// Run serves until ctx ends.
func (m *metricsServer) Run(ctx context.Context) error {
	defer m.reg.Unregister(m.col)
	errc := make(chan error, 1)
	go func() { errc <- m.srv.Serve(m.ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("metrics server: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	err := m.srv.Shutdown(sctx)
	if sErr := <-errc; sErr != nil && !errors.Is(sErr, http.ErrServerClosed) {
		return sErr
	}
	return err
}

// healthChecks are the workers' own health (a pod source that cannot reach its end), served by /healthz.
var (
	healthMu     sync.Mutex
	healthChecks = map[string]func() error{}
)

// registerHealth adds a worker's health check to /healthz: nil while healthy, else why not.
func registerHealth(name string, check func() error) {
	healthMu.Lock()
	defer healthMu.Unlock()
	healthChecks[name] = check
}

// checkHealth joins the failing checks' errors, in name order.
func checkHealth() error {
	healthMu.Lock()
	defer healthMu.Unlock()
	names := make([]string, 0, len(healthChecks))
	for n := range healthChecks {
		names = append(names, n)
	}
	sort.Strings(names)
	var errs []error
	for _, n := range names {
		if err := healthChecks[n](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
