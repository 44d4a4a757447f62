package puller

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// ErrPullQueueFull is wrapped by Enqueue when the node's pull queue already holds
// events.MaxPullRequestsPerNode requests: the stream refuses the message at once (DiscardNewPerSubject),
// so the caller gets backpressure instead of blocking, whatever the number of publishers or pullers.
var ErrPullQueueFull = errors.New("pull queue full")

// Enqueue stores a pull request in node's work queue, its partition stream (events.PullSubject; de-duplicated
// by its ID) and returns its stream sequence. The pull stream's only limit is the per-node one, so the
// stream's refusal (bus.ErrStreamLimit, the server's error code, not its text) is ErrPullQueueFull.
func Enqueue(ctx context.Context, b *bus.Bus, node string, req events.PullRequest) (uint64, error) {
	return EnqueueIn(ctx, b, "", node, req)
}

// EnqueueIn is Enqueue for a node whose pull queue is in the JetStream domain domain (a leaf's, as the node's
// heartbeat reports it in events.NodeInfo.JSDomain; "" is the fleet's own): the request is addressed to that
// domain (events.DomainSubject), where only the node's leaf stores it.
func EnqueueIn(ctx context.Context, b *bus.Bus, domain, node string, req events.PullRequest) (uint64, error) {
	subject := events.DomainSubject(domain, events.PullSubject(node))
	seq, err := b.PublishCommand(ctx, subject, req.ID, req, nil)
	if errors.Is(err, bus.ErrStreamLimit) {
		return 0, fmt.Errorf("publish command to %s: %w", subject, ErrPullQueueFull)
	}
	return seq, err
}

// QueueCollector exports, for each node, the depth of its pull work queue and the pull tokens in use,
// read from the node's durable pull consumer (events.PullerDurable on its partition stream,
// events.PullStreamOf) at every scrape:
//
//	imagefleet_pull_queue_depth{node}      pull commands waiting (the consumer's NumPending)
//	imagefleet_pull_tokens_in_use{node}    pulls in flight (NumAckPending)
//	imagefleet_pull_tokens{node}           the node's token limit (MaxAckPending)
//
// A node whose consumer does not exist yet is left out of the scrape. While a node still has a durable on
// the legacy single queue (a rolling upgrade), its waiting and in-flight requests are added in
// (compat_single_queue.go).
type QueueCollector struct {
	b       *bus.Bus
	nodes   []string
	timeout time.Duration

	depth, inUse, tokens *prometheus.Desc
}

// NewQueueCollector reads the pull consumer of each of nodes.
func NewQueueCollector(b *bus.Bus, nodes []string) *QueueCollector {
	return &QueueCollector{
		b: b, nodes: nodes, timeout: 2 * time.Second,
		depth:  prometheus.NewDesc("imagefleet_pull_queue_depth", "Pull commands waiting in the node's work queue.", []string{"node"}, nil),
		inUse:  prometheus.NewDesc("imagefleet_pull_tokens_in_use", "Pulls in flight on the node (unacked pull commands).", []string{"node"}, nil),
		tokens: prometheus.NewDesc("imagefleet_pull_tokens", "The node's pull token limit (the consumer's MaxAckPending).", []string{"node"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *QueueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.depth
	ch <- c.inUse
	ch <- c.tokens
}

// Collect implements prometheus.Collector.
func (c *QueueCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	for _, node := range c.nodes {
		q, err := c.b.Consumer(ctx, events.PullStreamOf(node), events.PullerDurable(node))
		if err != nil {
			continue
		}
		q = c.addLegacy(ctx, node, q) // compat_single_queue.go
		ch <- prometheus.MustNewConstMetric(c.depth, prometheus.GaugeValue, float64(q.NumPending), node)
		ch <- prometheus.MustNewConstMetric(c.inUse, prometheus.GaugeValue, float64(q.NumAckPending), node)
		ch <- prometheus.MustNewConstMetric(c.tokens, prometheus.GaugeValue, float64(q.MaxAckPending), node)
	}
}
