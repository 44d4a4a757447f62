package podindex

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestNewRegistersTheMetrics: New registers the index's metrics on its config's Registerer, a second index
// of the process registers nothing twice, and a collector of another kind under one of their names is an
// error from New, not a panic.
func TestNewRegistersTheMetrics(t *testing.T) {
	_, b := bustest.Start(t)
	reg := prometheus.NewRegistry()
	for range 2 {
		if _, err := New(Config{Node: testNode, Registerer: reg}, b); err != nil {
			t.Fatal(err)
		}
	}
	for name, c := range map[string]prometheus.Collector{
		"imagefleet_podindex_events_applied_total":  eventsApplied,
		"imagefleet_podindex_events_rejected_total": eventsRejected,
		"imagefleet_podindex_ref_transitions_total": refTransitions,
		"imagefleet_podindex_event_gaps_total":      eventGaps,
	} {
		if !reg.Unregister(c) {
			t.Errorf("%s is not registered on the config's Registerer", name)
		}
	}

	taken := prometheus.NewRegistry()
	taken.MustRegister(prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "imagefleet_podindex_event_gaps_total",
		Help: "a gauge of the same name"}, []string{"node"}))
	if _, err := New(Config{Node: testNode, Registerer: taken}, b); err == nil {
		t.Fatal("New registered its metrics beside a gauge of one of their names")
	} else {
		t.Logf("error: %v", err)
	}
}
