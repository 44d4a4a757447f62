package controller

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/internal/promreg"
)

// metrics are the controller's series, registered on Config.Registerer.
type metrics struct {
	// statusWrites counts status patches per kind: O(waves + failures) per object, whatever the fleet's size.
	statusWrites *prometheus.CounterVec
	// running counts the objects whose rollout runs on this replica.
	running *prometheus.GaugeVec
	// policyConflicts counts the nodes whose ImageGCPolicy merge the last policy sync refused (checkMerge):
	// a gauge, as the sync is level-based and finds the same conflict again at every resync.
	policyConflicts prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	w, err := promreg.RegisterOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_controller_status_writes_total",
		Help: "Status writes of ImagePrePull and ImageGC objects by the controller, by kind.",
	}, []string{"kind"}))
	if err != nil {
		return nil, err
	}
	r, err := promreg.RegisterOrReuse(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "imagefleet_controller_rollouts_running",
		Help: "ImagePrePull and ImageGC objects whose rollout runs on this controller replica, by kind.",
	}, []string{"kind"}))
	if err != nil {
		return nil, err
	}
	pc, err := promreg.RegisterOrReuse(reg, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "imagefleet_controller_gc_policy_conflicting_nodes",
		Help: "Nodes whose ImageGCPolicy objects merge into a configuration the node would refuse (Ready reason ConflictingPolicies), as of the last policy sync; their effective policy is not written.",
	}))
	if err != nil {
		return nil, err
	}
	return &metrics{statusWrites: w, running: r, policyConflicts: pc}, nil
}
