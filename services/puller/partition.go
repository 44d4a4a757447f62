package puller

import (
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
