package bus

import (
	"log/slog"
	"strings"
	"sync/atomic"

	"github.com/nats-io/nats.go"
)

// A JetStream push consumer delivers a stream's messages to its deliver subject, and the server checks that
// subject against nothing but its own syntax: a client allowed to create a consumer on a stream it may read
// (a node on its own events) can point one at any subject of the account, another node's commands among
// them, and have the server deliver there what it stored under its own name. Publish permissions never see
// that delivery.
//
// Every core subscription the bus makes for a worker (Listen, RespondListen, Subscribe, SubscribeSync, the
// key follower's notices) therefore drops a message a consumer delivered: its reply subject is the
// consumer's ack subject ($JS.ACK.…) or flow-control subject ($JS.FC.…), or it is a status message (an idle
// heartbeat) with no body. Nothing the workers serve or watch is ever delivered by a push consumer; the bus
// reads streams with pull consumers on inboxes of its own, which this does not touch.

// deliveredByConsumer reports whether m came from a JetStream push consumer rather than a publish.
func deliveredByConsumer(m *nats.Msg) bool {
	if strings.HasPrefix(m.Reply, "$JS.ACK.") || strings.HasPrefix(m.Reply, "$JS.FC.") {
		return true
	}
	return len(m.Data) == 0 && m.Header.Get("Status") != ""
}

// refusedLogged makes the first refused delivery of the process a warning; the rest are counted only (a
// consumer pointed at a worker delivers every message of its stream).
var refusedLogged atomic.Bool

// refuseDelivered counts and drops m when a consumer delivered it, and reports whether it did.
func refuseDelivered(log *slog.Logger, m *nats.Msg) bool {
	if !deliveredByConsumer(m) {
		return false
	}
	deliveriesRefused.Inc()
	if refusedLogged.CompareAndSwap(false, true) {
		log.Warn("dropped a message a JetStream push consumer delivered to a worker's subject: some client pointed a consumer here (imagefleet_bus_consumer_deliveries_refused_total counts them)",
			"subscription", subscriptionOf(m), "stored_subject", m.Subject, "reply", m.Reply)
	}
	return true
}

// subscriptionOf is the subject of the subscription m came on (a consumer delivers a message under the
// subject it was stored with).
func subscriptionOf(m *nats.Msg) string {
	if m.Sub == nil {
		return ""
	}
	return m.Sub.Subject
}
