package kevents

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/tools/record"

	"github.com/imagefleet/imagefleet/events"
)

// DedupBucket holds, per imagefleet event, the Kubernetes write the bridge decided for it (create or patch,
// with the exact body) before it is sent: keys <node token>.<event key>. A redelivered event (the agent
// stopped between the API's answer and the ack, or the API was away) replays that same write instead of
// correlating again, so it is counted once.
const DedupBucket = events.KubeEventsBucket

// DefaultComponent is the source component of the Events the bridge posts.
const DefaultComponent = "imagefleet"

// Durable is the bridge's durable consumer on the events stream for node: "kube-events-" + node token. It is
// API: renaming it posts the whole stream again (bounded by DedupTTL).
func Durable(node string) string { return events.KubeEventsDurable(node) }

// Config configures the bridge.
type Config struct {
	// Node is the node whose events are posted (required); it is also the Events' source host and
	// reportingInstance, and the Node object of node warnings (the kubelet's nodeRef: name and UID both the
	// node name).
	Node string
	// Component is the Events' source component and reportingController (default "imagefleet"; "kubelet"
	// makes `kubectl describe` show them as the kubelet's own).
	Component string
	// Durable is the consumer's name (default Durable(Node)).
	Durable string
	// DedupTTL is how long a decided write is kept for replay (default 24h). An event redelivered later than
	// this after its write is correlated again: a create then finds its deterministic name taken
	// (AlreadyExists, success); only a count patch could count twice.
	DedupTTL time.Duration
	// RetryMax caps the wait between attempts while the API server refuses or cannot be reached
	// (default 10s). The event is held (and the ones behind it wait) until it is accepted.
	RetryMax time.Duration
	// AckWait is the consumer's ack wait (default 60s); the handler signals progress while it retries.
	AckWait time.Duration
	// VerifyPods checks that a pod an event is about is known to the API server (a list with
	// spec.nodeName=<node> and the pod's name, allowed to a node identity and to the deploy's RBAC) before
	// posting: events about pods only imagefleet knows (static manifests it reads, `imagefleet pods apply`)
	// are logged and not posted. Default true (nil).
	VerifyPods *bool
	// Correlator are client-go's correlator options (zero: client-go's defaults, as the kubelet uses:
	// aggregation of 10 similar events in 10 minutes, a spam filter of burst 25 refilled every 5 minutes per
	// source and object).
	Correlator record.CorrelatorOptions
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the bridge's metrics (default prometheus.DefaultRegisterer).
	Registerer prometheus.Registerer
}

func (c *Config) setDefaults() error {
	if err := events.ValidateNodeName(c.Node); err != nil {
		return err
	}
	if c.Component == "" {
		c.Component = DefaultComponent
	}
	if c.Durable == "" {
		c.Durable = Durable(c.Node)
	}
	if c.DedupTTL == 0 {
		c.DedupTTL = 24 * time.Hour
	}
	if c.DedupTTL < 0 {
		return fmt.Errorf("kube events dedup TTL %v must not be negative", c.DedupTTL)
	}
	if c.RetryMax == 0 {
		c.RetryMax = 10 * time.Second
	}
	if c.AckWait == 0 {
		c.AckWait = 60 * time.Second
	}
	if c.RetryMax <= 0 || c.AckWait <= 2*c.RetryMax {
		return fmt.Errorf("kube events retry max %v must be positive and under half the ack wait %v", c.RetryMax, c.AckWait)
	}
	if c.VerifyPods == nil {
		t := true
		c.VerifyPods = &t
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	return nil
}
