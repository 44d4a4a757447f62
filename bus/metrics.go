package bus

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus/journal"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// Pipeline metrics. The agent registers them (RegisterMetrics) on prometheus.DefaultRegisterer, beside the
// kubelet metrics the workers register, and its metrics endpoint serves the default gatherer.
// Labels are bounded: entity and action are the event type's, consumer is a durable name, reason one of
// lostReasons, subject is the subject a worker serves (one per worker and node, not one per request).
var (
	eventsPublished = publishedAtZero(prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_events_published_total",
		Help: "Events stored in the events stream (acked by the server), by entity and action.",
	}, []string{"entity", "action"}))
	msgsConsumed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_messages_consumed_total",
		Help: "Messages delivered to a handler of a durable consumer.",
	}, []string{"consumer"})
	msgsAcked = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_messages_acked_total",
		Help: "Messages acked after their handler succeeded.",
	}, []string{"consumer"})
	msgsNaked = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_messages_naked_total",
		Help: "Messages handed back for redelivery (handler error or shutdown).",
	}, []string{"consumer"})
	msgsTerminated = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_messages_terminated_total",
		Help: "Messages terminated (permanent error or deliveries exhausted).",
	}, []string{"consumer"})
	handlerErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_handler_errors_total",
		Help: "Consumer handler errors, permanent or not.",
	}, []string{"consumer"})
	deadLetters = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_dead_letters_total",
		Help: "Messages stored in the dead-letter stream.",
	}, []string{"consumer"})
	pullsLost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_pulls_lost_total",
		Help: "Pull requests of a durable consumer (or of the readers of Read on a stream: consumer=tail:<stream>) " +
			"found lost and sent again, by how: no_heartbeat (the server's heartbeats on it stopped for 2 s), " +
			"no_responders (no server took it), leader_changed (a new consumer leader dropped it), consumer_deleted " +
			"(the consumer was deleted: made anew), refused (another status ended it), watchdog (the stall watchdog " +
			"found none waiting, messages stuck, or no answer: made anew), sequence_gap (a reader's delivery " +
			"skipped a message: made anew after the last one it took).",
	}, []string{"consumer", "reason"})
	requestsServed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_requests_served_total",
		Help: "Requests answered, by served subject.",
	}, []string{"subject"})
	requestErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imagefleet_bus_request_errors_total",
		Help: "Requests answered with an error, by served subject.",
	}, []string{"subject"})
	natsReconnects = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imagefleet_nats_reconnects_total",
		Help: "Reconnections to NATS.",
	})
	deliveriesRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imagefleet_bus_consumer_deliveries_refused_total",
		Help: "Messages a JetStream push consumer delivered to a subject a worker serves or watches, dropped unread: " +
			"only a publish reaches a worker (some client with consumer-create rights pointed a consumer there).",
	})
)

// RegisterMetrics registers the bus's pipeline metrics and its event journal's on reg (the agent's: the
// default registerer its metrics endpoint serves). Registering them on the same registry again is a no-op,
// so each agent of a process (a test's, the demo's) may call it; the series are the process's, shared.
func RegisterMetrics(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{eventsPublished, msgsConsumed, msgsAcked, msgsNaked, msgsTerminated,
		handlerErrors, deadLetters, pullsLost, requestsServed, requestErrors, natsReconnects, deliveriesRefused} {
		if err := registerOnce(reg, c); err != nil {
			return fmt.Errorf("register bus metrics: %w", err)
		}
	}
	return journal.RegisterMetrics(reg)
}

// registerOnce registers c on reg unless c itself is there already; another collector of the same
// description is an error (c's counts would not be the ones served).
func registerOnce(reg prometheus.Registerer, c prometheus.Collector) error {
	got, err := promreg.RegisterOrReuse(reg, c)
	if err != nil {
		return err
	}
	if got != c {
		return errors.New("another collector of the same name is registered")
	}
	return nil
}

// publishedAtZero exports cv's series of every event type the workers publish at 0.
func publishedAtZero(cv *prometheus.CounterVec) *prometheus.CounterVec {
	for _, t := range publishedTypes {
		cv.WithLabelValues(t[0], t[1])
	}
	return cv
}

// publishedTypes are the entity and action of every event type the workers publish. Each series, and each
// consumer's and served subject's below, is exported at 0 before its first increment, so that an alert on
// rate() or increase() sees the first event and needs no `or vector(0)`.
var publishedTypes = [][2]string{
	{events.EntityImage, events.ActionDetected}, {events.EntityImage, events.ActionRemoved},
	{events.EntityImage, events.ActionVanished}, {events.EntityNode, events.ActionWarning},
	{events.EntityGC, events.ActionFinished},
	{events.EntityPull, events.ActionPulling}, {events.EntityPull, events.ActionPulled},
	{events.EntityPull, events.ActionFailed},
	{events.EntityPod, events.ActionAdded}, {events.EntityPod, events.ActionUpdated},
	{events.EntityPod, events.ActionDeleted},
	{events.EntitySecret, events.ActionRegistered}, {events.EntitySecret, events.ActionUnregistered},
	{events.EntityConfigMap, events.ActionRegistered}, {events.EntityConfigMap, events.ActionUnregistered},
}

// initConsumerMetrics exports the counters of a durable consumer at 0.
func initConsumerMetrics(consumer string) {
	for _, cv := range []*prometheus.CounterVec{msgsConsumed, msgsAcked, msgsNaked, msgsTerminated, handlerErrors, deadLetters} {
		cv.WithLabelValues(consumer)
	}
	initLostPullMetrics(consumer)
}

// initLostPullMetrics exports imagefleet_bus_pulls_lost_total of a pull loop at 0: a durable consumer's, or
// tail:<stream> for the readers (Read) of stream.
func initLostPullMetrics(consumer string) {
	for _, reason := range lostReasons {
		pullsLost.WithLabelValues(consumer, reason)
	}
}

// initServedMetrics exports the counters of a served subject at 0.
func initServedMetrics(subject string) {
	requestsServed.WithLabelValues(subject)
	requestErrors.WithLabelValues(subject)
}

// countPublished counts one stored event of type t.
func countPublished(t string) {
	entity, action, _, err := events.ParseType(t)
	if err != nil {
		return
	}
	eventsPublished.WithLabelValues(entity, action).Inc()
}

// countHandled counts the outcome of one consumed message: "ack", "nak", "term".
func countHandled(consumer, outcome string, err error) {
	msgsConsumed.WithLabelValues(consumer).Inc()
	if err != nil {
		handlerErrors.WithLabelValues(consumer).Inc()
	}
	switch outcome {
	case "ack":
		msgsAcked.WithLabelValues(consumer).Inc()
	case "nak":
		msgsNaked.WithLabelValues(consumer).Inc()
	case "term":
		msgsTerminated.WithLabelValues(consumer).Inc()
	}
}

// countLostPull counts a pull request of consumer found lost, by the lost* reason.
func countLostPull(consumer, reason string) {
	pullsLost.WithLabelValues(consumer, reason).Inc()
}

// countServed counts one answered request on subject.
func countServed(subject string, failed bool) {
	requestsServed.WithLabelValues(subject).Inc()
	if failed {
		requestErrors.WithLabelValues(subject).Inc()
	}
}

// subjectOf is the subject a request was served on: the subscription's (a bounded label), not the request's.
func subjectOf(m *nats.Msg) string {
	if m.Sub != nil {
		return m.Sub.Subject
	}
	return m.Subject
}

// onReconnect is called by the connection's reconnect handler.
func (b *Bus) onReconnect() {
	natsReconnects.Inc()
	b.journalOnReconnect()
	b.callReconnectFns()
}
