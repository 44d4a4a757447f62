// Package promreg registers a worker's Prometheus collectors so that several workers of one kind in one
// process (the demo's nodes, a test's services) share the series, as one kubelet would.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// RegisterOrReuse registers c on reg, or returns the collector of the same description already there. A
// collector registered there under that description but of another kind than C is an error, never a panic
// and never a collector silently left unregistered.
func RegisterOrReuse[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		var zero C
		return zero, err
	}
	return c, nil
}
