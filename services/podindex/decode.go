package podindex

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	jsonv1 "github.com/go-json-experiment/json/v1"
	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// PodEvent is one decoded pod event.
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

// Rejection reasons, the label values of the rejected-events counter.
const (
	ReasonBadSubject = "bad_subject"
	ReasonBadType    = "bad_type"
	ReasonBadPod     = "bad_pod"
	ReasonNoUID      = "no_uid"
	ReasonTooLarge   = "too_large"
)

// DecodeError is why a pod event was rejected; it wraps events.ErrMalformed.
type DecodeError struct {
	Reason string // one of the Reason constants
	Msg    string
}

func (e *DecodeError) Error() string { return "malformed pod event: " + e.Msg }

// Unwrap makes errors.Is(err, events.ErrMalformed) true.
func (e *DecodeError) Unwrap() error { return events.ErrMalformed }

func reject(reason, format string, args ...any) error {
	return &DecodeError{Reason: reason, Msg: fmt.Sprintf(format, args...)}
}

// RejectReason is the reason label of a decode error ("other" for an error that is not a DecodeError).
func RejectReason(err error) string {
	var de *DecodeError
	if errors.As(err, &de) {
		return de.Reason
	}
	return "other"
}

// DecodePodEvent decodes a message of imagefleet.evt.<node>.pod.<action>: the action is the subject's last
// token (added, updated or deleted); a ce-type header, when present, must be imagefleet.pod.<action>.v1; the
// body is a core/v1 Pod as JSON (unknown fields are ignored, as API clients do) with a name, a namespace and
// a UID. Every error is a *DecodeError.
//
// The body is decoded by unmarshalPod: it accepts and rejects what encoding/json does, and decodes to the
// same Pod (FuzzPodDecoderMatchesEncodingJSON checks that, input by input). Only the error texts differ.
func DecodePodEvent(subject string, header map[string][]string, data []byte) (PodEvent, error) {
	i := strings.LastIndexByte(subject, '.')
	if i < 0 || !strings.HasSuffix(subject[:i], "."+events.EntityPod) {
		return PodEvent{}, reject(ReasonBadSubject, "subject %q is not imagefleet.evt.<node>.pod.<action>", subject)
	}
	action := subject[i+1:]
	switch action {
	case events.ActionAdded, events.ActionUpdated, events.ActionDeleted:
	default:
		return PodEvent{}, reject(ReasonBadType, "unknown pod event type %q (want added, updated or deleted)", action)
	}
	if ceType := headerGet(header, bus.HeaderType); ceType != "" && ceType != events.TypeName(events.EntityPod, action) {
		return PodEvent{}, reject(ReasonBadType, "ce-type %q does not match the subject's action %q", ceType, action)
	}
	if len(data) > events.MaxMessageBytes {
		return PodEvent{}, reject(ReasonTooLarge, "pod of %d bytes is over the limit of %d", len(data), events.MaxMessageBytes)
	}
	pod := &v1.Pod{}
	if err := unmarshalPod(data, pod); err != nil {
		return PodEvent{}, reject(ReasonBadPod, "body is not a core/v1 Pod: %s", describeJSON(err))
	}
	if pod.Kind != "" && pod.Kind != "Pod" {
		return PodEvent{}, reject(ReasonBadPod, "body is a %q, not a Pod", pod.Kind)
	}
	if pod.APIVersion != "" && pod.APIVersion != "v1" {
		return PodEvent{}, reject(ReasonBadPod, "pod apiVersion %q is not v1", pod.APIVersion)
	}
	if pod.Name == "" {
		return PodEvent{}, reject(ReasonBadPod, "pod has no metadata.name")
	}
	if pod.Namespace == "" {
		return PodEvent{}, reject(ReasonBadPod, "pod %q has no metadata.namespace", pod.Name)
	}
	if pod.UID == "" {
		return PodEvent{}, reject(ReasonNoUID, "pod %s/%s has no metadata.uid", pod.Namespace, pod.Name)
	}
	ev := PodEvent{Action: action, ID: headerGet(header, bus.HeaderID), Pod: pod, Raw: data}
	if action != events.ActionDeleted {
		ev.prep.set(pod)
	}
	return ev, nil
}

// podJSON are the options of unmarshalPod: github.com/go-json-experiment/json with the encoding/json
// emulation of its v1 package (the one Go's own encoding/json is built on from Go 1.27; GOEXPERIMENT=jsonv2
// in 1.25-1.26), less its legacy error reporting. That legacy part only shapes errors, but to report a
// syntax error ahead of a type error as encoding/json does, it scans the whole body before decoding it: a
// quarter of the decoder's time on a pod. Without it the body is decoded in one pass and stops at its first
// error; what is accepted, and the Pod it gives, are the same (a syntax error and a type error both reject).
// The option's other differences are errors in Go struct types that encoding/json passes over: a JSON name
// matching several fields without case, two fields with one name, an unexported field with a tag and the
// like. None can happen with a Pod: TestPodFieldNamesDifferWithoutCase and
// TestPodStructsAreValidForTheDecoder check every struct type a Pod reaches, so a k8s.io/api upgrade that
// brought one in fails them.
var podJSON = json.JoinOptions(jsonv1.DefaultOptionsV1(), jsonv1.ReportErrorsWithLegacySemantics(false))

// unmarshalPod decodes a pod's JSON as encoding/json would, faster (see podJSON).
func unmarshalPod(data []byte, pod *v1.Pod) error { return json.Unmarshal(data, pod, podJSON) }

// describeJSON says where and why a body did not decode to a Pod.
func describeJSON(err error) string {
	var semErr *json.SemanticError
	var synErr *jsontext.SyntacticError
	switch {
	case errors.As(err, &synErr):
		return fmt.Sprintf("invalid JSON at offset %d: %v", synErr.ByteOffset, synErr.Err)
	case errors.As(err, &semErr):
		msg := "the body"
		if semErr.JSONPointer != "" {
			msg = fmt.Sprintf("field %q", strings.Join(slices.Collect(semErr.JSONPointer.Tokens()), "."))
		}
		if semErr.GoType != nil {
			msg += " must be " + semErr.GoType.String()
		}
		if kind := jsonKindName(semErr.JSONKind); kind != "" {
			msg += ", not " + kind
		}
		if semErr.Err != nil {
			msg += ": " + semErr.Err.Error()
		}
		return msg
	default:
		return err.Error()
	}
}

// jsonKindName names a JSON kind as encoding/json's errors do ("" when unknown).
func jsonKindName(k jsontext.Kind) string {
	switch k {
	case 'n':
		return "null"
	case 't', 'f':
		return "bool"
	case '"':
		return "string"
	case '0':
		return "number"
	case '{':
		return "object"
	case '[':
		return "array"
	default:
		return ""
	}
}

func headerGet(h map[string][]string, key string) string {
	if v := h[key]; len(v) > 0 {
		return v[0]
	}
	for k, v := range h {
		if len(v) > 0 && strings.EqualFold(k, key) {
			return v[0]
		}
	}
	return ""
}

// PodEventMsg builds the message of a pod event: subject imagefleet.evt.<node>.pod.<action>, body the pod
// as JSON, CloudEvents binary-mode headers and Nats-Msg-Id = ce-id = id (a new random id when empty).
func PodEventMsg(node, action string, pod *v1.Pod, id string, at time.Time) (bus.RawMsg, error) {
	body, err := jsonv1.Marshal(pod)
	if err != nil {
		return bus.RawMsg{}, fmt.Errorf("encode pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return PodEventRaw(node, action, body, id, at), nil
}

// PodEventRaw is PodEventMsg with the pod already encoded.
func PodEventRaw(node, action string, body []byte, id string, at time.Time) bus.RawMsg {
	if id == "" {
		id = events.NewID()
	}
	return bus.RawMsg{
		Subject: events.EventSubject(node, events.EntityPod, action),
		MsgID:   id,
		Data:    body,
		Header: map[string]string{
			bus.HeaderSpecVersion: "1.0",
			bus.HeaderType:        events.TypeName(events.EntityPod, action),
			bus.HeaderSource:      bus.SourcePrefix + node,
			bus.HeaderID:          id,
			bus.HeaderTime:        at.UTC().Format(time.RFC3339Nano),
			bus.HeaderContentType: "application/json",
		},
	}
}
