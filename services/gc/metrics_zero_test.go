package gc

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestRemovedCounterExportedAtZero: kubelet_image_garbage_collected_total has both reasons at 0 before the
// first removal.
func TestRemovedCounterExportedAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	cv, err := newRemovedCounter(reg)
	if err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "kubelet_image_garbage_collected_total"); n != 2 {
		t.Errorf("%d series before any removal, want 2 (space, age) at 0", n)
	}
	for _, r := range []string{ReasonSpace, ReasonAge} {
		if v := testutil.ToFloat64(cv.WithLabelValues(r)); v != 0 {
			t.Errorf("reason %q = %v, want 0", r, v)
		}
	}
}
