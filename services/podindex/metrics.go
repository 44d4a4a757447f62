package podindex

import "github.com/prometheus/client_golang/prometheus"

// Metrics of every pod index in the process, registered with the default Prometheus registry.
var (
	eventsApplied = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_podindex_events_applied_total",
		Help: "Pod events applied to the pod index, by action.",
	}, []string{"node", "action"})
	eventsRejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_podindex_events_rejected_total",
		Help: "Pod events rejected as malformed (kept as dead letters), by reason.",
	}, []string{"node", "reason"})
	refTransitions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_podindex_ref_transitions_total",
		Help: "Secret and configmap reference counts going 0 -> 1 (registered) or 1 -> 0 (unregistered).",
	}, []string{"node", "kind", "action"})
)

func init() {
	prometheus.MustRegister(eventsApplied, eventsRejected, refTransitions)
}
