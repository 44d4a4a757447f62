package puller

import (
	"context"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// ConsumerConfig is the node's pull consumer: events.PullerDurable on the node's partition stream
// (events.PullStreamOf), filtered to its requests (events.PullSubject), MaxAckPending = its pull tokens, so the
// server holds the token limit across every replica. Exported so that scale tests and benchmarks make
// consumers exactly as the puller does.
func ConsumerConfig(cfg Config) bus.ConsumerConfig {
	tokens := cfg.Tokens()
	cc := bus.ConsumerConfig{Stream: events.PullStreamOf(cfg.Node), Durable: events.PullerDurable(cfg.Node),
		FilterSubjects: []string{events.PullSubject(cfg.Node)},
		MaxAckPending:  tokens, AckWait: cfg.AckWait, MaxDeliver: cfg.MaxDeliver}
	if tokens == 0 {
		cc.MaxAckPending, cc.Concurrency = 1000, 256
	}
	return cc
}

// legacyConsumerConfig is the node's consumer on the legacy single pull queue (events.PullStream), bound, never
// created: an agent of an earlier release made it.
func legacyConsumerConfig(cfg Config) bus.ConsumerConfig {
	cc := ConsumerConfig(cfg)
	cc.Stream, cc.FilterSubjects, cc.Bind = events.PullStream, []string{events.LegacyPullSubject(cfg.Node)}, true
	return cc
}

// drainLegacy runs the pull requests queued in the legacy single pull queue (events.PullStream) by a CLI or
// orchestrator of an earlier release, during a rolling upgrade: when the node's legacy durable exists (an
// agent of an earlier release made it), the puller consumes it too, with the same handler. It never creates
// it: a node that never ran an earlier agent has none, and a removed legacy queue (the last step of the
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
