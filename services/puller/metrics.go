package puller

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/internal/promreg"
)

// imagePullDurationBuckets are the kubelet's buckets of kubelet_image_pull_duration_seconds.
var imagePullDurationBuckets = []float64{1, 5, 10, 20, 30, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600}

type imageSizeBucket struct {
	lowerBound uint64
	label      string
}

// imageSizeBuckets are the kubelet's image_size_in_bytes labels (binary units).
var imageSizeBuckets = []imageSizeBucket{
	{0, "0-10MB"},
	{10 << 20, "10MB-100MB"},
	{100 << 20, "100MB-500MB"},
	{500 << 20, "500MB-1GB"},
	{1 << 30, "1GB-5GB"},
	{5 << 30, "5GB-10GB"},
	{10 << 30, "10GB-20GB"},
	{20 << 30, "20GB-30GB"},
	{30 << 30, "30GB-40GB"},
	{40 << 30, "40GB-60GB"},
	{60 << 30, "60GB-100GB"},
	{100 << 30, "GT100GB"},
}

// imageSizeBucket is the kubelet's GetImageSizeBucket: "N/A" for 0 (size unknown), else the bucket whose
// lower bound the size exceeds.
func sizeBucket(size uint64) string {
	if size == 0 {
		return "N/A"
	}
	for i := len(imageSizeBuckets) - 1; i >= 0; i-- {
		if size > imageSizeBuckets[i].lowerBound {
			return imageSizeBuckets[i].label
		}
	}
	return ""
}

// metrics are the kubelet's image manager metrics, with the kubelet's names, plus the puller's own.
type metrics struct {
	ensureRequests *prometheus.CounterVec
	pullDuration   *prometheus.HistogramVec
	malformed      prometheus.Counter
	shared         prometheus.Counter
	cancelled      prometheus.Counter
	mustPullChecks *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		ensureRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Subsystem: "kubelet", Name: "image_manager_ensure_image_requests_total",
			Help: "Number of ensure-image requests processed by the kubelet.",
		}, []string{"pull_policy", "present_locally", "pull_required"}),
		pullDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubelet", Name: "image_pull_duration_seconds",
			Help: "Duration in seconds to pull an image.", Buckets: imagePullDurationBuckets,
		}, []string{"image_size_in_bytes"}),
		malformed: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "imagefleet", Subsystem: "puller", Name: "malformed_requests_total",
			Help: "Pull requests that could not be decoded or validated (terminated as dead letters).",
		}),
		shared: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "imagefleet", Subsystem: "puller", Name: "shared_pulls_total",
			Help: "Requests that joined a runtime pull of the same image already in progress.",
		}),
		cancelled: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "imagefleet", Subsystem: "puller", Name: "cancelled_pulls_total",
			Help: "Pull requests cancelled because their pod was deleted or on request.",
		}),
		mustPullChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Subsystem: "kubelet", Name: "imagemanager_image_mustpull_checks_total",
			Help: "Counter for how many times kubelet checked whether credentials need to be re-verified to access an image",
		}, []string{"result"}),
	}
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	var err error
	if m.ensureRequests, err = register(reg, m.ensureRequests); err != nil {
		return nil, err
	}
	// Every label combination is exported at 0 before its first increment (alerts need no `or vector(0)`).
	for _, policy := range []string{"always", "ifnotpresent", "never"} {
		for _, present := range []string{"true", "false", "unknown"} {
			for _, required := range []string{"true", "false", "unknown"} {
				m.ensureRequests.WithLabelValues(policy, present, required)
			}
		}
	}
	if m.pullDuration, err = register(reg, m.pullDuration); err != nil {
		return nil, err
	}
	if m.malformed, err = register(reg, m.malformed); err != nil {
		return nil, err
	}
	if m.shared, err = register(reg, m.shared); err != nil {
		return nil, err
	}
	if m.cancelled, err = register(reg, m.cancelled); err != nil {
		return nil, err
	}
	if m.mustPullChecks, err = register(reg, m.mustPullChecks); err != nil {
		return nil, err
	}
	for _, result := range []string{checkCredentialPolicyAllowed, checkCredentialRecordFound, checkMustAuthenticate, checkError} {
		m.mustPullChecks.WithLabelValues(result)
	}
	return m, nil
}

// register registers c, or returns the collector already registered under its name (two pullers in one
// process, as in the demo, share the series).
func register[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	c, err := promreg.RegisterOrReuse(reg, c)
	if err != nil {
		return c, fmt.Errorf("register puller metrics: %w", err)
	}
	return c, nil
}

func optBool(b *bool) string {
	if b == nil {
		return "unknown"
	}
	return strconv.FormatBool(*b)
}

func (m *metrics) recordEnsure(policy string, presentLocally, pullRequired *bool) {
	m.ensureRequests.WithLabelValues(strings.ToLower(policy), optBool(presentLocally), optBool(pullRequired)).Inc()
}
