package events

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// Severity values, as Kubernetes event types.
const (
	Normal  = "Normal"
	Warning = "Warning"
)

// Event is the envelope every imagefleet event shares. Type carries the version
// (imagefleet.image.removed.v1); changes are additive, and a breaking change is a new version.
// Reason, Message and Severity carry the kubelet's exact text where the kubelet has an event, so a bridge can
// post them as Kubernetes Events.
type Event struct {
	Type     string    `json:"type"`
	ID       string    `json:"id"`
	Time     time.Time `json:"time"`
	Node     string    `json:"node"`
	Reason   string    `json:"reason,omitempty"`
	Message  string    `json:"message,omitempty"`
	Severity string    `json:"severity,omitempty"`
	// Object names what the event is about when it is a Kubernetes object (the node, a pod).
	Object *ObjectRef `json:"object,omitempty"`
	// Data is the type-specific body.
	Data json.RawMessage `json:"data,omitempty"`
}

// ObjectRef is the Kubernetes object an event is about.
type ObjectRef struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
	FieldPath string `json:"fieldPath,omitempty"`
}

// TypeName builds the versioned type name of an entity and action: imagefleet.<entity>.<action>.v1.
func TypeName(entity, action string) string { return Prefix + "." + entity + "." + action + ".v1" }

// ParseType splits a type name into entity, action and version.
func ParseType(t string) (entity, action, version string, err error) {
	parts := strings.Split(t, ".")
	if len(parts) != 4 || parts[0] != Prefix || parts[1] == "" || parts[2] == "" || !strings.HasPrefix(parts[3], "v") {
		return "", "", "", fmt.Errorf("event type %q is not of the form imagefleet.<entity>.<action>.v<N>", t)
	}
	return parts[1], parts[2], parts[3], nil
}

// NewID returns a new random event id (128 bits, hex).
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// New builds an event of entity/action on node with data marshalled as its body.
func New(node, entity, action string, data any) (Event, error) {
	ev := Event{Type: TypeName(entity, action), ID: NewID(), Time: time.Now().UTC(), Node: node}
	if data != nil {
		raw, err := json.Marshal(data)
		if err != nil {
			return Event{}, fmt.Errorf("marshal %s data: %w", ev.Type, err)
		}
		ev.Data = raw
	}
	return ev, nil
}

// WithKube sets the Kubernetes-style reason, message and severity.
func (e Event) WithKube(severity, reason, message string, obj *ObjectRef) Event {
	e.Severity, e.Reason, e.Message, e.Object = severity, reason, message, obj
	return e
}

// Subject is the subject the event is published on.
func (e Event) Subject() (string, error) {
	entity, action, _, err := ParseType(e.Type)
	if err != nil {
		return "", err
	}
	return EventSubject(e.Node, entity, action), nil
}

// Validate checks the envelope.
func (e Event) Validate() error {
	if _, _, _, err := ParseType(e.Type); err != nil {
		return err
	}
	if e.ID == "" {
		return fmt.Errorf("event %s has no id", e.Type)
	}
	if e.Time.IsZero() {
		return fmt.Errorf("event %s %s has no time", e.Type, e.ID)
	}
	if err := ValidateNodeName(e.Node); err != nil {
		return fmt.Errorf("event %s %s: %w", e.Type, e.ID, err)
	}
	if e.Severity != "" && e.Severity != Normal && e.Severity != Warning {
		return fmt.Errorf("event %s %s: severity %q is neither Normal nor Warning", e.Type, e.ID, e.Severity)
	}
	return nil
}

// DecodeData decodes the event's body into v.
func (e Event) DecodeData(v any) error {
	if len(e.Data) == 0 {
		return fmt.Errorf("event %s %s has no data", e.Type, e.ID)
	}
	if err := json.Unmarshal(e.Data, v); err != nil {
		return fmt.Errorf("decode %s data: %w", e.Type, err)
	}
	return nil
}
