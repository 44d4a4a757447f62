package gc

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// newRemovedCounter registers the kubelet's kubelet_image_garbage_collected_total{reason} on reg, or reuses
// the one already registered there (several executors in one process share it, as one kubelet would).
func newRemovedCounter(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	cv := prometheus.NewCounterVec(prometheus.CounterOpts{
		Subsystem: "kubelet",
		Name:      "image_garbage_collected_total",
		Help:      "Total number of images garbage collected by the kubelet, whether through disk usage or image age.",
	}, []string{"reason"})
	if err := reg.Register(cv); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return existing, nil
			}
		}
		return nil, err
	}
	return cv, nil
}

// metricReason is the metric label of a removal reason: DeleteUnusedImages counts under "space", as in the
// kubelet (its freeSpace always uses the space reason).
func metricReason(reason string) string {
	if reason == ReasonAge {
		return ReasonAge
	}
	return ReasonSpace
}
