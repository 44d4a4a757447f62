package podsource

import "github.com/prometheus/client_golang/prometheus"

// Metrics of every pod source in the process, registered with the default Prometheus registry.
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

func init() {
	prometheus.MustRegister(sourceUp, sourceErrors, sourceEvents, sourceResyncs, sourceRepairs)
}
