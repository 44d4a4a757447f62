package puller

import (
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/events"
)

// Config configures the puller of one node. Flag names are the kubelet's where it has the setting.
type Config struct {
	// Node is the node name (required).
	Node string
	// PullOnPodAdd (--pull-on-pod-add): a pod.added event of the node enqueues a pull for each of the pod's
	// images (PodPullRequests), so images are on the node before its containers start.
	PullOnPodAdd bool
	// SerializeImagePulls (--serialize-image-pulls): one pull at a time. Default: true when
	// MaxParallelImagePulls is nil or below 2, else false (the kubelet's defaulting).
	SerializeImagePulls *bool
	// MaxParallelImagePulls (--max-parallel-image-pulls): the node's pull tokens in parallel mode, enforced
	// by the server as the consumer's MaxAckPending across every replica. nil: no limit.
	MaxParallelImagePulls *int32
	// RegistryPullQPS (--registry-qps) and RegistryBurst (--registry-burst): the token bucket every pull
	// must pass, without waiting ("pull QPS exceeded"). 0 QPS: unlimited. The kubelet's defaults are 5 and
	// 10; the agent's flags default to them, the zero Config is unlimited.
	RegistryPullQPS float64
	RegistryBurst   int
	// BackoffInitial and BackoffMax are the pull backoff (default 10s and 300s, the kubelet's).
	BackoffInitial, BackoffMax time.Duration
	// CredentialVerificationPolicy is KEP-2535's imagePullCredentialsVerificationPolicy (default
	// NeverVerifyPreloadedImages); PreloadedImagesAllowlist goes with NeverVerifyAllowlistedImages.
	CredentialVerificationPolicy string
	PreloadedImagesAllowlist     []string
	// PullSecretsDir holds Secret manifests (JSON or YAML) the pods' pull secrets are found in by
	// namespace and name (default: none; pods' secrets are then not found).
	PullSecretsDir string
	// NodeKeyring is a docker config.json whose credentials every pod on the node may use (default none).
	NodeKeyring string
	// AckWait is how long the work queue waits for a sign of life before redelivering a request to another
	// replica (default 30s); the puller signals progress every AckWait/3 during a pull.
	AckWait time.Duration
	// MaxDeliver bounds deliveries of one request (default 5); then it becomes a dead letter.
	MaxDeliver int
	// DeletedPodMemory is how long a deleted pod's UID is remembered, so its queued requests are dropped
	// (default 10m).
	DeletedPodMemory time.Duration
	// ImageGCHighThresholdPercent is the node's image GC high threshold: at or above it, or when the image
	// does not fit in the available bytes, a runtime pull asks the GC executor for a pass first (see room).
	// 0: no room is made before pulls (the kubelet's behaviour). The agent sets it from
	// --image-gc-high-threshold.
	ImageGCHighThresholdPercent int
	// PullRoomMarginPercent is the share of the image filesystem that stands for an image whose size the
	// registry does not tell (default 5).
	PullRoomMarginPercent int
	// Now is the clock of backoff and the QPS bucket (default time.Now).
	Now func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the metrics (default: a private registry).
	Registerer prometheus.Registerer
}

// Serialized reports whether pulls are serialized, after defaulting.
func (c Config) Serialized() bool {
	if c.SerializeImagePulls != nil {
		return *c.SerializeImagePulls
	}
	return c.MaxParallelImagePulls == nil || *c.MaxParallelImagePulls < 2
}

// Tokens is the node's pull tokens: 1 serialized, MaxParallelImagePulls in parallel, 0 for no limit.
func (c Config) Tokens() int {
	if c.Serialized() {
		return 1
	}
	if c.MaxParallelImagePulls == nil {
		return 0
	}
	return int(*c.MaxParallelImagePulls)
}

// Validate checks the configuration with the kubelet's messages (pkg/kubelet/apis/config/validation).
func (c Config) Validate() error {
	if err := events.ValidateNodeName(c.Node); err != nil {
		return err
	}
	if c.MaxParallelImagePulls != nil && *c.MaxParallelImagePulls < 1 {
		return fmt.Errorf("invalid configuration: maxParallelImagePulls %v must be a positive number", *c.MaxParallelImagePulls)
	}
	if c.Serialized() && c.MaxParallelImagePulls != nil && *c.MaxParallelImagePulls > 1 {
		return fmt.Errorf("invalid configuration: maxParallelImagePulls cannot be larger than 1 unless SerializeImagePulls (--serialize-image-pulls) is set to false")
	}
	if c.RegistryBurst < 0 {
		return fmt.Errorf("invalid configuration: registryBurst (--registry-burst) %v must not be a negative number", c.RegistryBurst)
	}
	if c.RegistryPullQPS < 0 {
		return fmt.Errorf("invalid configuration: registryPullQPS (--registry-qps) %v must not be a negative number", c.RegistryPullQPS)
	}
	if c.BackoffInitial < 0 || c.BackoffMax < 0 || (c.BackoffMax > 0 && c.BackoffInitial > c.BackoffMax) {
		return fmt.Errorf("pull backoff %v..%v must be positive and initial at most max", c.BackoffInitial, c.BackoffMax)
	}
	switch c.CredentialVerificationPolicy {
	case "", NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages, AlwaysVerify:
	default:
		return fmt.Errorf("invalid configuration: imagePullCredentialsVerificationPolicy %q must be one of NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages, AlwaysVerify", c.CredentialVerificationPolicy)
	}
	if len(c.PreloadedImagesAllowlist) > 0 && c.CredentialVerificationPolicy != NeverVerifyAllowlistedImages {
		return fmt.Errorf("invalid configuration: preloadedImagesVerificationAllowlist is only allowed with imagePullCredentialsVerificationPolicy NeverVerifyAllowlistedImages")
	}
	for _, a := range c.PreloadedImagesAllowlist {
		if strings.TrimSpace(a) != a || a == "" || strings.ContainsAny(a, "@") || (strings.Contains(a, "*") && !strings.HasSuffix(a, "/*")) {
			return fmt.Errorf("invalid configuration: preloadedImagesVerificationAllowlist entry %q must be a repository or a host/path/* prefix without tag or digest", a)
		}
	}
	if c.AckWait < 0 || c.MaxDeliver < 0 || c.DeletedPodMemory < 0 {
		return fmt.Errorf("ack wait, max deliver and deleted pod memory must not be negative")
	}
	return nil
}

func (c *Config) setDefaults() error {
	if err := c.Validate(); err != nil {
		return err
	}
	if c.BackoffInitial == 0 {
		c.BackoffInitial = 10 * time.Second
	}
	if c.BackoffMax == 0 {
		c.BackoffMax = 300 * time.Second
	}
	if c.CredentialVerificationPolicy == "" {
		c.CredentialVerificationPolicy = NeverVerifyPreloadedImages
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = 5
	}
	if c.DeletedPodMemory == 0 {
		c.DeletedPodMemory = 10 * time.Minute
	}
	if c.PullRoomMarginPercent == 0 {
		c.PullRoomMarginPercent = 5
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}
