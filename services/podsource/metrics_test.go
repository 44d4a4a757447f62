package podsource

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
)

type nopPub struct{}

func (nopPub) PublishMsgs(context.Context, []bus.RawMsg) (uint64, error) { return 0, nil }

// TestNewRegistersTheMetrics: building a source registers the sources' metrics on its config's Registerer,
// a second source of the process registers nothing twice, and a collector of another kind under one of
// their names is an error from the constructor, not a panic.
func TestNewRegistersTheMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	for range 2 {
		if _, err := NewKubeletSource(KubeletConfig{Node: testNode, Registerer: reg}, nopPub{}, nil); err != nil {
			t.Fatal(err)
		}
	}
	for name, c := range map[string]prometheus.Collector{
		"imagefleet_pod_source_up":                     sourceUp,
		"imagefleet_pod_source_errors_total":           sourceErrors,
		"imagefleet_pod_source_events_published_total": sourceEvents,
		"imagefleet_pod_source_repaired_pods_total":    sourceRepairs,
		"imagefleet_pod_source_resyncs_total":          sourceResyncs,
	} {
		if !reg.Unregister(c) {
			t.Errorf("%s is not registered on the config's Registerer", name)
		}
	}

	taken := prometheus.NewRegistry()
	taken.MustRegister(prometheus.NewCounterVec(prometheus.CounterOpts{Name: "imagefleet_pod_source_up",
		Help: "a counter of the same name"}, []string{"node", "source"}))
	if _, err := NewKubeletSource(KubeletConfig{Node: testNode, Registerer: taken}, nopPub{}, nil); err == nil {
		t.Fatal("NewKubeletSource registered its metrics beside a counter of one of their names")
	} else {
		t.Logf("error: %v", err)
	}
}
