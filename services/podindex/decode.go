package podindex

import (
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// PodEvent is one decoded pod event: events.PodEvent with what Apply needs of the pod worked out ahead.
type PodEvent struct {
	// Action is events.ActionAdded, ActionUpdated or ActionDeleted.
	Action string
	// ID is the ce-id header ("" when absent).
	ID  string
	Pod *v1.Pod
	// Raw is the body as received (the pod's JSON).
	Raw []byte

	// prep is what Apply needs of an added or updated pod that depends on the pod alone, worked out by the
	// decoder (State.Apply works it out when it is not).
	prep prepared
}

// Rejection reasons, the label values of the rejected-events counter (events.PodReject*).
const (
	ReasonBadSubject = events.PodRejectBadSubject
	ReasonBadType    = events.PodRejectBadType
	ReasonBadPod     = events.PodRejectBadPod
	ReasonNoUID      = events.PodRejectNoUID
	ReasonTooLarge   = events.PodRejectTooLarge
)

// rejectReason is the reason label of a decode error ("other" for an error that is not an
// *events.PodDecodeError).
func rejectReason(err error) string { return events.PodRejectReason(err) }

// DecodePodEvent decodes a pod event with the contract's one decoder (events.DecodePodEvent), then works out
// what Apply needs of the pod alone, off the applier's path. Every error is an *events.PodDecodeError.
func DecodePodEvent(subject string, header map[string][]string, data []byte) (PodEvent, error) {
	e, err := events.DecodePodEvent(subject, header, data)
	if err != nil {
		return PodEvent{}, err
	}
	ev := PodEvent{Action: e.Action, ID: e.ID, Pod: e.Pod, Raw: e.Raw}
	if ev.Action != events.ActionDeleted {
		ev.prep.set(ev.Pod)
	}
	return ev, nil
}

// PodEventMsg builds the message of a pod event: subject imagefleet.evt.<node>.pod.<action>, body the pod
// as JSON, the contract's CloudEvents headers and Nats-Msg-Id = ce-id = id (a new random id when empty).
func PodEventMsg(node, action string, pod *v1.Pod, id string, at time.Time) (bus.RawMsg, error) {
	body, err := events.EncodePod(pod)
	if err != nil {
		return bus.RawMsg{}, err
	}
	return bus.PodEventRaw(node, action, body, id, at), nil
}
