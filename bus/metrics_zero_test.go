package bus_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// series returns the value of the counter name{labels} in the default gatherer, and whether it is exported.
// The bus's metrics are registered there first, as the agent does.
func series(t *testing.T, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	if err := bus.RegisterMetrics(prometheus.DefaultRegisterer); err != nil {
		t.Fatal(err)
	}
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metrics
				}
			}
			return m.GetCounter().GetValue(), true
		}
	}
	return 0, false
}

// TestCountersExportedAtZero: the counters docs/operations.md lists are exported at 0 before their first
// increment: every event type's published count from the start, a consumer's counts once it consumes, a served
// subject's once it is served (alerts on rate() need no `or vector(0)`).
func TestCountersExportedAtZero(t *testing.T) {
	for _, c := range []struct{ entity, action string }{
		{"image", "removed"}, {"image", "detected"}, {"node", "warning"}, {"gc", "finished"}, {"pull", "failed"},
		{"pod", "added"}, {"secret", "registered"}, {"configmap", "unregistered"},
	} {
		if _, ok := series(t, "imagefleet_bus_events_published_total", map[string]string{"entity": c.entity, "action": c.action}); !ok {
			t.Errorf("imagefleet_bus_events_published_total{entity=%q,action=%q} is not exported", c.entity, c.action)
		}
	}
	for _, name := range []string{"imagefleet_nats_reconnects_total", "imagefleet_journal_appended_total",
		"imagefleet_journal_dropped_total", "imagefleet_journal_failed_attempts_total"} {
		if _, ok := series(t, name, nil); !ok {
			t.Errorf("%s is not exported", name)
		}
	}

	_, b := bustest.Start(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "Z", Subjects: []string{"z.>"}, WorkQueue: true}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 2)
	go func() {
		done <- b.Consume(ctx, bus.ConsumerConfig{Stream: "Z", Durable: "zero-consumer"}, func(context.Context, *bus.Msg) error { return nil })
	}()
	go func() {
		done <- b.Serve(ctx, "zero.subject", "q", func(context.Context, []byte) (any, error) { return nil, nil })
	}()
	want := map[string]map[string]string{
		"imagefleet_bus_messages_consumed_total":   {"consumer": "zero-consumer"},
		"imagefleet_bus_messages_acked_total":      {"consumer": "zero-consumer"},
		"imagefleet_bus_messages_naked_total":      {"consumer": "zero-consumer"},
		"imagefleet_bus_messages_terminated_total": {"consumer": "zero-consumer"},
		"imagefleet_bus_handler_errors_total":      {"consumer": "zero-consumer"},
		"imagefleet_bus_dead_letters_total":        {"consumer": "zero-consumer"},
		"imagefleet_bus_requests_served_total":     {"subject": "zero.subject"},
		"imagefleet_bus_request_errors_total":      {"subject": "zero.subject"},
	}
	for name, labels := range want {
		var v float64
		bustest.WaitWithin(t, fmt.Sprintf("%s%v exported after the consumer and the server started", name, labels), 10*time.Second,
			func() bool {
				var ok bool
				v, ok = series(t, name, labels)
				return ok
			})
		if v != 0 {
			t.Errorf("%s%v = %v before any message, want 0", name, labels, v)
		}
	}
	cancel()
	for range 2 {
		// Cancelled while the consumer is still being created, Consume says so.
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Error(err)
		}
	}
}

// TestRegisterMetrics: RegisterMetrics puts the bus's and the journal's metrics on the registry it is given
// (and only there), again is a no-op, and refuses a registry where another collector has one of the names.
func TestRegisterMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	for range 2 {
		if err := bus.RegisterMetrics(reg); err != nil {
			t.Fatalf("RegisterMetrics: %v", err)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, mf := range mfs {
		got[mf.GetName()] = true
	}
	// The series exported before any use: the others come with their first consumer, subject or loss.
	for _, name := range []string{"imagefleet_bus_events_published_total", "imagefleet_nats_reconnects_total",
		"imagefleet_bus_consumer_deliveries_refused_total",
		"imagefleet_journal_appended_total", "imagefleet_journal_pending_events", "imagefleet_journal_dropped_total",
		"imagefleet_journal_failed_attempts_total"} {
		if !got[name] {
			t.Errorf("%s not on the registry given", name)
		}
	}
	other := prometheus.NewRegistry()
	other.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "imagefleet_nats_reconnects_total", Help: "Reconnections to NATS."}))
	if err := bus.RegisterMetrics(other); err == nil {
		t.Error("RegisterMetrics on a registry holding another imagefleet_nats_reconnects_total: no error")
	}
}
