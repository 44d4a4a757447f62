package podsource

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/internal/promreg"
)

// Metrics of every pod source in the process: one set of series, shared by the sources of a process. Each
// source registers them on the Registerer of its config when it is built.
var (
	sourceUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "imagefleet_pod_source_up",
		Help: "1 while the pod source is connected to its end (the kubelet's Pods API or the API server) and synced, 0 while it cannot reach it (the index keeps its last state).",
	}, []string{"node", "source"})
	sourceErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_pod_source_errors_total",
		Help: "Errors of a pod source, by kind: connect (its end unreachable or the stream broke), decode (a malformed pod), publish (the bus refused an event).",
	}, []string{"node", "source", "kind"})
	sourceEvents = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_pod_source_events_published_total",
		Help: "Pod events a pod source published, by action.",
	}, []string{"node", "source", "action"})
	sourceRepairs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_pod_source_repaired_pods_total",
		Help: "Pods whose last event the pod index did not hold at a reconcile (lost from the events stream before it read them, or never published) and that the source published again.",
	}, []string{"node", "source"})
	sourceResyncs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_pod_source_resyncs_total",
		Help: "Full resyncs of a pod source against the index (at start, after a reconnect or relist, and periodically).",
	}, []string{"node", "source"})
)

// registerMetrics registers the pod sources' metrics on reg (prometheus.DefaultRegisterer when nil). It is
// idempotent: registering them again on the same registry (every source of a process does) is a no-op.
// Another collector already registered there under one of their names is an error.
func registerMetrics(reg prometheus.Registerer) error {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	for _, c := range []prometheus.Collector{sourceUp, sourceErrors, sourceEvents, sourceResyncs, sourceRepairs} {
		got, err := promreg.RegisterOrReuse(reg, c)
		if err != nil {
			return fmt.Errorf("pod source metrics: %w", err)
		}
		if got != c {
			return fmt.Errorf("pod source metrics: another collector is registered under the name of one of them")
		}
	}
	return nil
}
