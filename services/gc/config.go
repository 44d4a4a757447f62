package gc

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/events"
)

// Policy is the kubelet's ImageGCPolicy.
type Policy struct {
	// HighThresholdPercent: image GC runs when the image filesystem usage is at or above it (kubelet default 85).
	HighThresholdPercent int
	// LowThresholdPercent: image GC frees bytes down to this usage (kubelet default 80).
	LowThresholdPercent int
	// MinAge: an image is not removed before it has been known this long (firstDetected; kubelet default 2m).
	MinAge time.Duration
	// MaxAge: an unused image older than this is removed whatever the usage (0 disables; kubelet default 0).
	MaxAge time.Duration
}

// DefaultPolicy is the kubelet's default policy: 85 %, 80 %, 2m, 0s.
func DefaultPolicy() Policy {
	return Policy{HighThresholdPercent: 85, LowThresholdPercent: 80, MinAge: 2 * time.Minute}
}

// Validate checks the policy as the kubelet's NewImageGCManager does, in the same order and with the same
// texts. It allows Low == High (the kubelet's configuration validation does not, see Config).
func (p Policy) Validate() error {
	if p.HighThresholdPercent < 0 || p.HighThresholdPercent > 100 {
		return fmt.Errorf("invalid HighThresholdPercent %d, must be in range [0-100]", p.HighThresholdPercent)
	}
	if p.LowThresholdPercent < 0 || p.LowThresholdPercent > 100 {
		return fmt.Errorf("invalid LowThresholdPercent %d, must be in range [0-100]", p.LowThresholdPercent)
	}
	if p.LowThresholdPercent > p.HighThresholdPercent {
		return fmt.Errorf("LowThresholdPercent %d can not be higher than HighThresholdPercent %d", p.LowThresholdPercent, p.HighThresholdPercent)
	}
	if p.MinAge < 0 {
		return fmt.Errorf("imageMinimumGCAge %v must not be negative", p.MinAge)
	}
	if p.MaxAge < 0 {
		return fmt.Errorf("imageMaximumGCAge %v must not be negative", p.MaxAge)
	}
	return nil
}

// disabled is the kubelet's condition for not starting the periodic image GC at all.
func (p Policy) disabled() bool { return p.HighThresholdPercent == 100 && p.MaxAge == 0 }

// Config configures the GC executor of one node.
type Config struct {
	// Node is the node name (required).
	Node string
	// Policy is the image GC policy (use DefaultPolicy(); the zero Policy is rejected because the low
	// threshold must be below the high one).
	Policy Policy
	// CapacityBytes is a byte quota for images (--image-fs-capacity): when > 0, capacity = CapacityBytes and
	// used = the sum of the image sizes, instead of statfs of the runtime's image filesystem (default 0: statfs).
	CapacityBytes int64
	// PinnedImages are references and globs of images never removed, whatever the runtime reports
	// (--pinned-images; matched against RepoTags, RepoDigests and the image ID; default none).
	PinnedImages []string
	// Period between periodic GC passes (default 5m, the kubelet's ImageGCPeriod).
	Period time.Duration
	// CheckPeriod between checks of the image filesystem's usage (default 10s): a pass starts between periods
	// as soon as a check finds usage at or above the high threshold (--image-gc-check-period).
	CheckPeriod time.Duration
	// RemovalParallelism is how many images are removed at once (default 16; 1 is the kubelet's serial way).
	RemovalParallelism int
	// DetectTimeout bounds the detect request sent to the detector before each pass (default 1m).
	DetectTimeout time.Duration
	// InUseTimeout bounds the in-use query sent to the pod index before each removal batch (default 5s).
	InUseTimeout time.Duration
	// LeaseTTL is the TTL of the node's GC pass lease when this executor creates its bucket (default
	// DefaultLeaseTTL; keep the default: `imagefleet bus init` creates the bucket with it). Tests shorten it.
	LeaseTTL time.Duration
	// LeaseWait bounds how long a manual or pull-triggered request waits for another replica's pass (default
	// DefaultLeaseWait).
	LeaseWait time.Duration
	// PolicyRetry is how long the executor waits before it reads its ImageGCPolicy key again after a read
	// failed (the bucket not there yet, NATS away) (default 1s, doubling up to 30s).
	PolicyRetry time.Duration
	// PolicyResync is how often the executor reads its ImageGCPolicy key whatever the controller announced
	// (a notice lost with a connection), each wait drawn between half and one and a half times it (default
	// 5m: 33 direct gets a second across 10,000 nodes).
	PolicyResync time.Duration
	// Registerer receives kubelet_image_garbage_collected_total (default prometheus.DefaultRegisterer).
	Registerer prometheus.Registerer
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Validate checks the configuration as the kubelet's configuration validation does (prefix
// "invalid configuration: ", every error reported, aggregated as the kubelet does), then the policy as
// NewImageGCManager does.
//
// imageMaximumGCAge > imageMinimumGCAge is kept, with the kubelet's message, although
// kubernetes/kubernetes#132372 shows the rule compares two different clocks. imagefleet keeps it so that a
// kubelet configuration is accepted here exactly when the kubelet accepts it; the age pass here measures age
// from max(lastUsed, firstDetected) and honours MinAge itself, so the rule is no longer needed for safety.
// Per-request overrides (events.GCRequest) are checked like NewImageGCManager only, without this rule.
func (c Config) Validate() error {
	if err := events.ValidateNodeName(c.Node); err != nil {
		return err
	}
	p := c.Policy
	var errs []error
	if p.HighThresholdPercent < 0 || p.HighThresholdPercent > 100 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCHighThresholdPercent (--image-gc-high-threshold) %v must be between 0 and 100, inclusive", p.HighThresholdPercent))
	}
	if p.LowThresholdPercent < 0 || p.LowThresholdPercent > 100 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCLowThresholdPercent (--image-gc-low-threshold) %v must be between 0 and 100, inclusive", p.LowThresholdPercent))
	}
	if p.LowThresholdPercent >= p.HighThresholdPercent {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCLowThresholdPercent (--image-gc-low-threshold) %v must be less than imageGCHighThresholdPercent (--image-gc-high-threshold) %v", p.LowThresholdPercent, p.HighThresholdPercent))
	}
	if p.MinAge < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageMinimumGCAge %v must not be negative", p.MinAge))
	}
	if p.MaxAge < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageMaximumGCAge %v must not be negative", p.MaxAge))
	}
	if p.MaxAge > 0 && p.MaxAge <= p.MinAge {
		errs = append(errs, fmt.Errorf("invalid configuration: imageMaximumGCAge %v must be greater than imageMinimumGCAge %v", p.MaxAge, p.MinAge))
	}
	// Settings the kubelet does not have, in the same style.
	if c.CapacityBytes < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageFsCapacity (--image-fs-capacity) %v must not be negative", c.CapacityBytes))
	}
	if c.RemovalParallelism < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCRemovalParallelism (--image-gc-removal-parallelism) %v must not be negative", c.RemovalParallelism))
	}
	if c.CheckPeriod < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCCheckPeriod (--image-gc-check-period) %v must not be negative", c.CheckPeriod))
	}
	if c.Period < 0 {
		errs = append(errs, fmt.Errorf("invalid configuration: imageGCPeriod (--image-gc-period) %v must not be negative", c.Period))
	}
	if _, err := newRefMatcher(c.PinnedImages, true); err != nil {
		errs = append(errs, fmt.Errorf("invalid configuration: pinnedImages (--pinned-images): %w", err))
	}
	if err := aggregate(errs); err != nil {
		return err
	}
	return p.Validate()
}

func (c *Config) setDefaults() {
	if c.Period == 0 {
		c.Period = 5 * time.Minute
	}
	if c.CheckPeriod == 0 {
		c.CheckPeriod = 10 * time.Second
	}
	if c.RemovalParallelism == 0 {
		c.RemovalParallelism = 16
	}
	if c.DetectTimeout <= 0 {
		c.DetectTimeout = time.Minute
	}
	if c.InUseTimeout <= 0 {
		c.InUseTimeout = 5 * time.Second
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.LeaseWait <= 0 {
		c.LeaseWait = DefaultLeaseWait
	}
	if c.PolicyResync <= 0 {
		c.PolicyResync = 5 * time.Minute
	}
	if c.PolicyRetry <= 0 {
		c.PolicyRetry = time.Second
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// aggregateError is k8s.io/apimachinery's utilerrors aggregate: one error reads as itself, several as
// "[a, b]" with duplicate texts once.
type aggregateError []error

func aggregate(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return aggregateError(errs)
}

func (a aggregateError) Error() string {
	if len(a) == 1 {
		return a[0].Error()
	}
	seen := make(map[string]bool, len(a))
	var msgs []string
	for _, e := range a {
		if m := e.Error(); !seen[m] {
			seen[m] = true
			msgs = append(msgs, m)
		}
	}
	if len(msgs) == 1 {
		return msgs[0]
	}
	out := "["
	for i, m := range msgs {
		if i > 0 {
			out += ", "
		}
		out += m
	}
	return out + "]"
}

// Unwrap lets errors.Is and errors.As see every error.
func (a aggregateError) Unwrap() []error { return a }
