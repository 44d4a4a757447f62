// Compatibility path: the single pull queue IMAGEFLEET_PULL (events.PullStream).
//
// Before the pull work queue was partitioned, every node's pull requests went to one work-queue stream, where
// an agent of that layout made the node's durable (events.PullerDurable, filtered to
// events.LegacyPullSubject). A CLI or orchestrator of that layout still queues pulls there during a rolling
// upgrade: the puller drains the node's durable on it beside its partition's (drainLegacy, started by Run),
// and the queue metrics count its requests with the partition's (QueueCollector).
//
// Remove when: no supported release publishes to the single queue (the release after the partitioned
// queue's next; docs/upgrading.md, "Compatibility paths").

package puller

import (
	"context"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// legacyConsumerConfig is the node's consumer on the legacy single pull queue (events.PullStream), bound, never
// created: an agent of the single-queue layout made it.
func legacyConsumerConfig(cfg Config) bus.ConsumerConfig {
	cc := ConsumerConfig(cfg)
	cc.Stream, cc.FilterSubjects, cc.Bind = events.PullStream, []string{events.LegacyPullSubject(cfg.Node)}, true
	return cc
}

// drainLegacy runs the pull requests queued in the legacy single pull queue (events.PullStream) by a CLI or
// orchestrator of the single-queue layout, during a rolling upgrade: when the node's legacy durable exists
// (an agent of that layout made it), the puller consumes it too, with the same handler. It never creates it:
// a node that never ran an agent of that layout has none, and a removed legacy queue (the last step of the
// upgrade) ends the drain quietly. The token limit holds per process (the manager's tokens); across replicas
// the two consumers each hold MaxAckPending = tokens, so for the length of the upgrade a node with several
// replicas may run up to twice its tokens (docs/operations.md).
func drainLegacy(ctx context.Context, b *bus.Bus, cfg Config, h bus.MsgHandler) error {
	err := b.Consume(ctx, legacyConsumerConfig(cfg), h)
	if bus.IsConsumerNotFound(err) || bus.IsStreamNotFound(err) {
		return nil // none, or removed after the upgrade
	}
	return err
}

// addLegacy adds to q, node's partition consumer, the waiting and in-flight requests of node's durable on
// the legacy single queue, if it has one: during an upgrade the node drains it too.
func (c *QueueCollector) addLegacy(ctx context.Context, node string, q bus.ConsumerState) bus.ConsumerState {
	if l, err := c.b.Consumer(ctx, events.PullStream, events.PullerDurable(node)); err == nil {
		q.NumPending, q.NumAckPending = q.NumPending+l.NumPending, q.NumAckPending+l.NumAckPending
	}
	return q
}
