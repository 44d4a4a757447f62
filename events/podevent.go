package events

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
)

// The pod event contract: the pod index's input, published by `imagefleet pods`, the static-pod source and
// any API bridge, read by the pod index, the puller (pod.added, pod.deleted) and `imagefleet events`.
//
//	subject  imagefleet.evt.<node token>.pod.<action>  (EventSubject(node, EntityPod, action))
//	action   added, updated or deleted: the subject's last token
//	body     a Kubernetes core/v1 Pod as JSON (not an Event envelope)
//	headers  CloudEvents binary mode (PodEventHeader): ce-specversion 1.0, ce-type imagefleet.pod.<action>.v1
//	         (when present it must agree with the subject), ce-source imagefleet://node/<node>,
//	         ce-id = Nats-Msg-Id, ce-time, content-type application/json
//
// Every reader decodes it with DecodePodEvent, so each accepts and refuses the same messages for the same
// reasons.

// CloudEvents binary-mode headers (the NATS protocol binding puts each attribute in a ce- header).
const (
	HeaderSpecVersion = "ce-specversion"
	HeaderType        = "ce-type"
	HeaderSource      = "ce-source"
	HeaderID          = "ce-id"
	HeaderTime        = "ce-time"
	HeaderContentType = "content-type"
)

// SourcePrefix starts the ce-source of every event: SourcePrefix + node name.
const SourcePrefix = "imagefleet://node/"

// CloudEventHeader is the CloudEvents binary-mode header of an event of type typ with id, from node, at:
// what every event publisher writes (the events envelope and the pod events alike).
func CloudEventHeader(typ, id, node string, at time.Time) map[string]string {
	return map[string]string{
		HeaderSpecVersion: "1.0",
		HeaderType:        typ,
		HeaderSource:      SourcePrefix + node,
		HeaderID:          id,
		HeaderTime:        at.UTC().Format(time.RFC3339Nano),
		HeaderContentType: "application/json",
	}
}

// PodEventHeader is the header of a pod event of node: CloudEventHeader with type imagefleet.pod.<action>.v1.
func PodEventHeader(node, action, id string, at time.Time) map[string]string {
	return CloudEventHeader(TypeName(EntityPod, action), id, node, at)
}

// EncodePod is a pod event's body: the Pod as JSON.
func EncodePod(pod *v1.Pod) ([]byte, error) {
	body, err := jsonv1.Marshal(pod)
	if err != nil {
		return nil, fmt.Errorf("encode pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return body, nil
}

// PodEvent is one decoded pod event.
type PodEvent struct {
	// Action is ActionAdded, ActionUpdated or ActionDeleted.
	Action string
	// ID is the ce-id header ("" when absent).
	ID  string
	Pod *v1.Pod
	// Raw is the body as received (the pod's JSON).
	Raw []byte
}

// Rejection reasons of a pod event (PodDecodeError.Reason), the label values of the pod index's
// rejected-events counter.
const (
	PodRejectBadSubject = "bad_subject"
	PodRejectBadType    = "bad_type"
	PodRejectBadPod     = "bad_pod"
	PodRejectNoUID      = "no_uid"
	PodRejectTooLarge   = "too_large"
)

// PodDecodeError is why a pod event was rejected; it wraps ErrMalformed.
type PodDecodeError struct {
	Reason string // one of the PodReject constants
	Msg    string
}

func (e *PodDecodeError) Error() string { return "malformed pod event: " + e.Msg }

// Unwrap makes errors.Is(err, ErrMalformed) true.
func (e *PodDecodeError) Unwrap() error { return ErrMalformed }

func rejectPod(reason, format string, args ...any) error {
	return &PodDecodeError{Reason: reason, Msg: fmt.Sprintf(format, args...)}
}

// PodRejectReason is the reason of a pod decode error ("other" for an error that is not a PodDecodeError).
func PodRejectReason(err error) string {
	var de *PodDecodeError
	if errors.As(err, &de) {
		return de.Reason
	}
	return "other"
}

// DecodePodEvent decodes a message of imagefleet.evt.<node>.pod.<action>: the action is the subject's last
// token (added, updated or deleted); a ce-type header, when present, must be imagefleet.pod.<action>.v1; the
// body is a core/v1 Pod as JSON (unknown fields are ignored, as API clients do) with a name, a namespace and
// a UID. Every error is a *PodDecodeError.
//
// The body is decoded by unmarshalPod: it accepts and rejects what encoding/json does, and decodes to the
// same Pod (FuzzPodDecoderMatchesEncodingJSON checks that, input by input). Only the error texts differ.
func DecodePodEvent(subject string, header map[string][]string, data []byte) (PodEvent, error) {
	i := strings.LastIndexByte(subject, '.')
	if i < 0 || !strings.HasSuffix(subject[:i], "."+EntityPod) {
		return PodEvent{}, rejectPod(PodRejectBadSubject, "subject %q is not imagefleet.evt.<node>.pod.<action>", subject)
	}
	action := subject[i+1:]
	switch action {
	case ActionAdded, ActionUpdated, ActionDeleted:
	default:
		return PodEvent{}, rejectPod(PodRejectBadType, "unknown pod event type %q (want added, updated or deleted)", action)
	}
	if ceType := headerGet(header, HeaderType); ceType != "" && ceType != TypeName(EntityPod, action) {
		return PodEvent{}, rejectPod(PodRejectBadType, "ce-type %q does not match the subject's action %q", ceType, action)
	}
	if strings.HasPrefix(headerGet(header, HeaderContentType), "application/cloudevents") {
		return PodEvent{}, rejectPod(PodRejectBadPod, structuredMode)
	}
	if len(data) > MaxMessageBytes {
		return PodEvent{}, rejectPod(PodRejectTooLarge, "pod of %d bytes is over the limit of %d", len(data), MaxMessageBytes)
	}
	pod := &v1.Pod{}
	if err := UnmarshalPod(data, pod); err != nil {
		return PodEvent{}, rejectPod(PodRejectBadPod, "body is not a core/v1 Pod: %v", err)
	}
	if pod.Kind != "" && pod.Kind != "Pod" {
		return PodEvent{}, rejectPod(PodRejectBadPod, "body is a %q, not a Pod", pod.Kind)
	}
	if pod.APIVersion != "" && pod.APIVersion != "v1" {
		return PodEvent{}, rejectPod(PodRejectBadPod, "pod apiVersion %q is not v1", pod.APIVersion)
	}
	if pod.Name == "" {
		if isStructuredCloudEvent(data) {
			return PodEvent{}, rejectPod(PodRejectBadPod, structuredMode)
		}
		return PodEvent{}, rejectPod(PodRejectBadPod, "pod has no metadata.name")
	}
	if pod.Namespace == "" {
		return PodEvent{}, rejectPod(PodRejectBadPod, "pod %q has no metadata.namespace", pod.Name)
	}
	if pod.UID == "" {
		return PodEvent{}, rejectPod(PodRejectNoUID, "pod %s/%s has no metadata.uid", pod.Namespace, pod.Name)
	}
	return PodEvent{Action: action, ID: headerGet(header, HeaderID), Pod: pod, Raw: data}, nil
}

// structuredMode is why a structured-mode CloudEvent is refused as a pod event.
const structuredMode = "body is a structured-mode CloudEvent; pod events are binary mode: the Pod as the body, " +
	"its attributes in ce- headers (as the CloudEvents NATS binding's binary mode)"

// isStructuredCloudEvent reports whether body is a JSON CloudEvent (it has a specversion attribute). Only
// asked of a body that decoded to a Pod without a name, so it costs nothing on the accepted path.
func isStructuredCloudEvent(body []byte) bool {
	var ce struct {
		SpecVersion string `json:"specversion"`
	}
	return json.Unmarshal(body, &ce, podJSON) == nil && ce.SpecVersion != ""
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

// UnmarshalPod decodes a Pod's JSON as DecodePodEvent does (what encoding/json accepts, to the same Pod);
// the error says where and why the body is not a Pod ("field \"metadata.name\" must be string, not number").
func UnmarshalPod(data []byte, pod *v1.Pod) error {
	if err := unmarshalPod(data, pod); err != nil {
		return errors.New(describePodJSON(err))
	}
	return nil
}

// describePodJSON says where and why a body did not decode to a Pod.
func describePodJSON(err error) string {
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
