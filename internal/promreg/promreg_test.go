package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestRegisterOrReuse(t *testing.T) {
	opts := prometheus.CounterOpts{Name: "x_total", Help: "x."}
	t.Run("first registers", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		c := prometheus.NewCounter(opts)
		got, err := RegisterOrReuse(reg, c)
		if err != nil || got != c {
			t.Fatalf("RegisterOrReuse = %v, %v; want the counter given", got, err)
		}
	})
	t.Run("second reuses the first", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		first, err := RegisterOrReuse(reg, prometheus.NewCounter(opts))
		if err != nil {
			t.Fatal(err)
		}
		second, err := RegisterOrReuse(reg, prometheus.NewCounter(opts))
		if err != nil {
			t.Fatal(err)
		}
		second.Inc()
		if v := testutil.ToFloat64(first); v != 1 {
			t.Errorf("the first counter reads %v after the second's Inc, want 1 (one shared series)", v)
		}
	})
	t.Run("another kind is an error", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		reg.MustRegister(prometheus.NewCounterFunc(opts, func() float64 { return 0 }))
		got, err := RegisterOrReuse(reg, prometheus.NewCounter(opts))
		if err == nil || got != nil {
			t.Fatalf("RegisterOrReuse = %v, %v; want an error", got, err)
		}
	})
	t.Run("another description is an error", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		reg.MustRegister(prometheus.NewCounter(opts))
		if _, err := RegisterOrReuse(reg, prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "other."})); err == nil {
			t.Fatal("RegisterOrReuse of a name registered with another help: no error")
		}
	})
}
