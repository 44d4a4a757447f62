package bus

import (
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// PodEventRaw is the message of a pod event whose pod is already encoded as JSON: subject
// imagefleet.evt.<node>.pod.<action>, the contract's CloudEvents headers (events.PodEventHeader) and
// Nats-Msg-Id = ce-id = id (a new random id when empty). Every writer of pod events (the pod index's
// static source and apply, the pod sources) builds its messages here.
func PodEventRaw(node, action string, body []byte, id string, at time.Time) RawMsg {
	if id == "" {
		id = events.NewID()
	}
	return RawMsg{
		Subject: events.EventSubject(node, events.EntityPod, action),
		MsgID:   id,
		Data:    body,
		Header:  events.PodEventHeader(node, action, id, at),
	}
}
