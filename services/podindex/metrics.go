package podindex

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/internal/promreg"
)

// Metrics of every pod index in the process: one set of series, shared by the indexes of a process (a
// test's, the demo's nodes) as one kubelet's would be. New registers them on its Config.Registerer.
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
	eventGaps = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_podindex_event_gaps_total",
		Help: "Times the pods stream (IMAGEFLEET_PODS; or IMAGEFLEET_EVENTS when a snapshot of an older release moves over) had dropped events the pod index had yet to read: pod events may be lost; the pod sources reconcile with the index to repair it.",
	}, []string{"node"})
)

// registerMetrics registers the pod index's metrics on reg. It is idempotent: registering them again on
// the same registry (every index of a process does) is a no-op. Another collector already registered there
// under one of their names is an error.
func registerMetrics(reg prometheus.Registerer) error {
	for _, c := range []*prometheus.CounterVec{eventsApplied, eventsRejected, refTransitions, eventGaps} {
		got, err := promreg.RegisterOrReuse(reg, c)
		if err != nil {
			return fmt.Errorf("pod index metrics: %w", err)
		}
		if got != c {
			return fmt.Errorf("pod index metrics: another collector is registered under the name of one of them")
		}
	}
	return nil
}
