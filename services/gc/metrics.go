package gc

import (
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// newRemovedCounter registers the kubelet's kubelet_image_garbage_collected_total{reason} on reg, or reuses
// the one already registered there (several executors in one process share it, as one kubelet would).
func newRemovedCounter(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	cv := prometheus.NewCounterVec(prometheus.CounterOpts{
		Subsystem: "kubelet",
		Name:      "image_garbage_collected_total",
		Help:      "Total number of images garbage collected by the kubelet, whether through disk usage or image age.",
	}, []string{"reason"})
	cv, err := promreg.RegisterOrReuse(reg, cv)
	if err != nil {
		return nil, err
	}
	// Both reasons exported at 0 before the first removal (alerts need no "or vector(0)").
	cv.WithLabelValues(ReasonSpace)
	cv.WithLabelValues(ReasonAge)
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

// metrics are the image GC metrics proposed by KEP-6053 ("Image GC observability", provisional: names and
// labels may change with the proposal). imagefleet exports them beside kubelet_image_garbage_collected_total,
// with one more trigger than the proposal: usage (the check between periods) and pull (room before a pull)
// besides periodic, and manual for a gc command.
type metrics struct {
	attempts  *prometheus.CounterVec   // operation, trigger, result, reason
	duration  *prometheus.HistogramVec // operation
	freed     *prometheus.HistogramVec // operation
	target    *prometheus.GaugeVec     // operation
	deletions *prometheus.CounterVec   // reason, result
	skipped   *prometheus.CounterVec   // reason
	usage     prometheus.Gauge         // phase=before
	after     prometheus.Gauge         // phase=after
}

// KEP-6053's operation values.
const (
	opGarbageCollect = "garbage_collect"
	opDeleteUnused   = "delete_unused_images"
)

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	attempts := prometheus.NewCounterVec(prometheus.CounterOpts{Subsystem: "kubelet", Name: "image_gc_attempts_total",
		Help: "Image garbage collection attempts, by operation, trigger, result and reason (KEP-6053, provisional)."},
		[]string{"operation", "trigger", "result", "reason"})
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{Subsystem: "kubelet", Name: "image_gc_duration_seconds",
		Help:    "Duration of image garbage collection passes (KEP-6053, provisional).",
		Buckets: []float64{0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}}, []string{"operation"})
	freed := prometheus.NewHistogramVec(prometheus.HistogramOpts{Subsystem: "kubelet", Name: "image_gc_freed_bytes",
		Help:    "Bytes freed by an image garbage collection pass, as the runtime declares the image sizes (KEP-6053, provisional).",
		Buckets: prometheus.ExponentialBuckets(1<<20, 4, 10)}, []string{"operation"})
	target := prometheus.NewGaugeVec(prometheus.GaugeOpts{Subsystem: "kubelet", Name: "image_gc_target_bytes",
		Help: "Bytes the last image garbage collection pass aimed to free; for delete_unused_images the eligible images' total (KEP-6053, provisional)."},
		[]string{"operation"})
	deletions := prometheus.NewCounterVec(prometheus.CounterOpts{Subsystem: "kubelet", Name: "image_gc_image_deletions_total",
		Help: "Image deletions attempted by image garbage collection, by reason and result (KEP-6053, provisional)."},
		[]string{"reason", "result"})
	skipped := prometheus.NewCounterVec(prometheus.CounterOpts{Subsystem: "kubelet", Name: "image_gc_skipped_images_total",
		Help: "Images image garbage collection kept, by reason (KEP-6053, provisional)."}, []string{"reason"})
	usage := prometheus.NewGaugeVec(prometheus.GaugeOpts{Subsystem: "kubelet", Name: "image_gc_image_fs_usage_percent",
		Help: "Image filesystem usage percent seen by image garbage collection: before a pass (and at each usage check), after a pass as measured (KEP-6053, provisional)."},
		[]string{"phase"})
	m := &metrics{}
	var err error
	if m.attempts, err = promreg.RegisterOrReuse(reg, attempts); err != nil {
		return nil, err
	}
	if m.duration, err = promreg.RegisterOrReuse(reg, duration); err != nil {
		return nil, err
	}
	if m.freed, err = promreg.RegisterOrReuse(reg, freed); err != nil {
		return nil, err
	}
	if m.target, err = promreg.RegisterOrReuse(reg, target); err != nil {
		return nil, err
	}
	if m.deletions, err = promreg.RegisterOrReuse(reg, deletions); err != nil {
		return nil, err
	}
	if m.skipped, err = promreg.RegisterOrReuse(reg, skipped); err != nil {
		return nil, err
	}
	uv, err := promreg.RegisterOrReuse(reg, usage)
	if err != nil {
		return nil, err
	}
	m.usage, m.after = uv.WithLabelValues("before"), uv.WithLabelValues("after")
	// Exported at zero before the first pass, so alerts need no "or vector(0)".
	for _, op := range []string{opGarbageCollect, opDeleteUnused} {
		m.duration.WithLabelValues(op)
		m.freed.WithLabelValues(op)
	}
	for _, r := range []string{ReasonSpace, ReasonAge, "all_unused"} {
		for _, res := range []string{"success", "error"} {
			m.deletions.WithLabelValues(r, res)
		}
	}
	for _, r := range []string{"in_use", "min_age", "pinned", "other"} {
		m.skipped.WithLabelValues(r)
	}
	return m, nil
}

// observe records one pass that removed for real (dry runs are not counted).
func (m *metrics) observe(allUnused bool, trigger string, res events.GCResult, err error) {
	op := opGarbageCollect
	if allUnused {
		op = opDeleteUnused
	}
	failed := res.FailedCount()
	removed := len(res.Removed) - failed
	var result, reason string
	switch {
	case err == nil && removed == 0:
		result, reason = "noop", "threshold"
	case err == nil:
		result, reason = "success", "threshold"
	case strings.HasPrefix(res.Error, "detect images"):
		result, reason = "error", "detect_error"
	case strings.Contains(res.Error, "image fs stats"):
		result, reason = "error", "stats_error"
	case strings.Contains(res.Error, "invalid capacity 0"):
		result, reason = "error", "invalid_capacity"
	case failed > 0 && removed > 0:
		result, reason = "partial", "delete_error"
	case failed > 0:
		result, reason = "error", "delete_error"
	case strings.Contains(res.Error, "Insufficient free disk space"):
		result, reason = "error", "insufficient_freed"
	default:
		result, reason = "error", "unknown"
	}
	if reason == "threshold" {
		switch {
		case allUnused:
			reason = "all_unused"
		case removed > 0 && !slices.ContainsFunc(res.Removed, func(r events.GCRemoved) bool { return r.Reason == ReasonSpace }):
			reason = "age"
		}
	}
	m.attempts.WithLabelValues(op, trigger, result, reason).Inc()
	m.duration.WithLabelValues(op).Observe(res.Duration.Seconds())
	m.freed.WithLabelValues(op).Observe(float64(res.FreedBytes))
	m.target.WithLabelValues(op).Set(float64(max(res.AmountToFree, 0)))
	for _, r := range res.Removed {
		rr := r.Reason
		if rr == ReasonUnused {
			rr = "all_unused"
		}
		result := "success"
		if r.Error != "" {
			result = "error"
		}
		m.deletions.WithLabelValues(rr, result).Inc()
	}
	for _, s := range res.Skipped {
		switch s.Why {
		case WhyInUse, WhyInUseAtRemoval:
			m.skipped.WithLabelValues("in_use").Inc()
		case WhyTooYoung:
			m.skipped.WithLabelValues("min_age").Inc()
		case WhyPinned, WhyPinnedByPolicy, WhySandboxImage:
			m.skipped.WithLabelValues("pinned").Inc()
		case WhyNotNeeded:
		default:
			m.skipped.WithLabelValues("other").Inc()
		}
	}
	if res.CapacityBytes > 0 {
		m.usage.Set(float64(res.UsagePercent))
		if res.MeasuredAvailableBytes > 0 {
			m.after.Set(float64(100 - int(res.MeasuredAvailableBytes*100/res.CapacityBytes)))
		}
	}
}
