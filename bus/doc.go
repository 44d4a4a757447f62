// Package bus is imagefleet's only door to NATS: the embedded nats-server (the default), connections that retry
// with backoff and survive server restarts, streams, KV buckets, request/reply with error replies, durable
// consumers with ack/term/redelivery semantics, and dead letters. No other package imports nats.
package bus
