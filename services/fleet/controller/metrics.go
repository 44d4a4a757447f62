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
	return &metrics{statusWrites: w, running: r}, nil
}
