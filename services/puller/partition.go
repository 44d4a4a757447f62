package puller

import (
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// ConsumerConfig is the node's pull consumer: events.PullerDurable on the node's partition stream
// (events.PullStreamOf), filtered to its requests (events.PullSubject), MaxAckPending = its pull tokens, so the
// server holds the token limit across every replica. On a replicated partition its state is kept in memory
// (bus.ConsumerConfig.MemoryStorageWhenReplicated): a file-storage consumer rewrites a state file on every
// server at each delivery and ack, which was about 30 % of the servers' CPU in a fleet pre-pull
// (docs/puller.md). Exported so that scale tests and benchmarks make consumers exactly as the puller does.
func ConsumerConfig(cfg Config) bus.ConsumerConfig {
	tokens := cfg.Tokens()
	cc := bus.ConsumerConfig{Stream: events.PullStreamOf(cfg.Node), Durable: events.PullerDurable(cfg.Node),
		FilterSubjects: []string{events.PullSubject(cfg.Node)},
		MaxAckPending:  tokens, AckWait: cfg.AckWait, MaxDeliver: cfg.MaxDeliver, MemoryStorageWhenReplicated: true}
	if tokens == 0 {
		cc.MaxAckPending, cc.Concurrency = 1000, 256
	}
	return cc
}
