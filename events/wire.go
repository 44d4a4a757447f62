package events

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// The event wire contract (every event but the pod events, see podevent.go), in two type versions:
//
//	subject  imagefleet.evt.<node token>.<entity>.<action>  (Event.Subject), stream IMAGEFLEET_EVENTS
//
//	v1 (imagefleet.<entity>.<action>.v1, deprecated, read until the date in docs/events.md):
//	  body     the Event envelope as JSON: type, id, time, node, reason, message, severity, object, data
//	  headers  CloudEventHeader: ce-specversion, ce-type, ce-source, ce-id, ce-time, content-type
//
//	v2 (imagefleet.<entity>.<action>.v2):
//	  body     the payload alone (Event.Data, JSON); empty when the event has none
//	  headers  ce-specversion 1.0, ce-type, ce-source imagefleet://node/<node>, ce-id, ce-time,
//	           ce-datacontenttype application/json, and the extension attributes ce-node, ce-reason,
//	           ce-message, ce-severity, ce-involvedkind, ce-involvednamespace, ce-involvedname,
//	           ce-involveduid, ce-involvedfieldpath (each only when set)
//
// Both are read by DecodeEventMsg (headers and body), so every reader accepts both versions during the
// deprecation period; EncodeEvent writes the version of the event's type. v1's encoder and decoder are in
// compat_event_v1.go.

// Event type versions.
const (
	V1 = "v1"
	V2 = "v2"
)

// Headers of the v2 wire format: the NATS binding's content type and imagefleet's extension attributes
// (CloudEvents extension names: lower-case a-z and 0-9 only).
const (
	HeaderDataContentType = "ce-datacontenttype"
	HeaderNode            = "ce-node"
	HeaderReason          = "ce-reason"
	HeaderMessage         = "ce-message"
	HeaderSeverity        = "ce-severity"
	HeaderInvolvedKind    = "ce-involvedkind"
	HeaderInvolvedNS      = "ce-involvednamespace"
	HeaderInvolvedName    = "ce-involvedname"
	HeaderInvolvedUID     = "ce-involveduid"
	HeaderInvolvedField   = "ce-involvedfieldpath"
)

// TypeNameVersion builds the type name of an entity and action at version (V1 or V2).
func TypeNameVersion(entity, action, version string) string {
	return Prefix + "." + entity + "." + action + "." + version
}

// ParseEventVersion checks a writer version flag's value: "v1" or "v2".
func ParseEventVersion(s string) (string, error) {
	switch s {
	case V1, V2:
		return s, nil
	}
	return "", fmt.Errorf("event version %q is neither %s nor %s", s, V1, V2)
}

// Version is the version of the event's type ("" when the type does not parse).
func (e Event) Version() string {
	_, _, v, err := ParseType(e.Type)
	if err != nil {
		return ""
	}
	return v
}

// Is reports whether the event is entity/action, whatever its type version.
func (e Event) Is(entity, action string) bool {
	en, a, _, err := ParseType(e.Type)
	return err == nil && en == entity && a == action
}

// AsVersion returns the event with its type at version (V1 or V2); pod events are not Events and keep
// their own contract (podevent.go).
func (e Event) AsVersion(version string) (Event, error) {
	entity, action, _, err := ParseType(e.Type)
	if err != nil {
		return Event{}, err
	}
	if _, err := ParseEventVersion(version); err != nil {
		return Event{}, err
	}
	e.Type = TypeNameVersion(entity, action, version)
	return e, nil
}

// EncodeEvent is the event as on the wire, by its type's version: the headers (without Nats-Msg-Id,
// which the bus sets to the id) and the body. It validates the event first.
func EncodeEvent(ev Event) (map[string]string, []byte, error) {
	if err := ev.Validate(); err != nil {
		return nil, nil, err
	}
	switch v := ev.Version(); v {
	case V1:
		return encodeV1(ev)
	case V2:
		h := CloudEventHeader(ev.Type, ev.ID, ev.Node, ev.Time)
		delete(h, HeaderContentType)
		h[HeaderDataContentType] = "application/json"
		set := func(k, v string) {
			if v = headerSafe(v); v != "" {
				h[k] = v
			}
		}
		set(HeaderNode, ev.Node)
		set(HeaderReason, ev.Reason)
		set(HeaderMessage, ev.Message)
		set(HeaderSeverity, ev.Severity)
		if o := ev.Object; o != nil {
			set(HeaderInvolvedKind, o.Kind)
			set(HeaderInvolvedNS, o.Namespace)
			set(HeaderInvolvedName, o.Name)
			set(HeaderInvolvedUID, o.UID)
			set(HeaderInvolvedField, o.FieldPath)
		}
		return h, []byte(ev.Data), nil
	default:
		return nil, nil, fmt.Errorf("event %s %s: type version %q is not written (want %s or %s)", ev.Type, ev.ID, v, V1, V2)
	}
}

// headerSafe makes s a valid NATS header value: a header cannot carry CR, LF or other control characters,
// so each becomes a space, and the parser trims surrounding blanks, so they are trimmed here (a decoded
// value is then exactly what was sent).
func headerSafe(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
		s = strings.Map(func(r rune) rune {
			if r < 0x20 || r == 0x7f {
				return ' '
			}
			return r
		}, s)
	}
	return strings.TrimSpace(s)
}

// DecodeEventMsg decodes an event message of either version from its headers and body, and validates it:
// a ce-type header of version v2 reads the envelope from the headers and takes the body as the data;
// otherwise the body is a v1 envelope (DecodeEvent). The Event's Type keeps the version it was sent
// with; readers match it with Is. Every error wraps ErrMalformed and says what is wrong. Pod events are
// decoded with DecodePodEvent.
func DecodeEventMsg(header map[string][]string, data []byte) (Event, error) {
	if len(data) > MaxMessageBytes {
		return Event{}, fmt.Errorf("%w: event of %d bytes is over the limit of %d", ErrMalformed, len(data), MaxMessageBytes)
	}
	ceType := headerGet(header, HeaderType)
	entity, _, version, err := ParseType(ceType)
	if ceType == "" || err != nil || version == V1 {
		return decodeV1Msg(header, data, ceType)
	}
	if entity == EntityPod {
		return Event{}, fmt.Errorf("%w: %s is a pod event (its body is a Pod; see DecodePodEvent)", ErrMalformed, ceType)
	}
	if version != V2 {
		return Event{}, fmt.Errorf("%w: event type %q has a version this release does not read (want %s or %s)", ErrMalformed, ceType, V1, V2)
	}
	if sv := headerGet(header, HeaderSpecVersion); sv != "1.0" {
		return Event{}, fmt.Errorf("%w: %s event has ce-specversion %q, want 1.0", ErrMalformed, ceType, sv)
	}
	if ct := headerGet(header, HeaderDataContentType); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return Event{}, fmt.Errorf("%w: %s event has ce-datacontenttype %q, want application/json", ErrMalformed, ceType, ct)
	}
	// Values as a NATS header carries them (headerSafe), so a header map built in memory reads as the wire.
	get := func(k string) string { return headerSafe(headerGet(header, k)) }
	ev := Event{
		Type:     ceType,
		ID:       get(HeaderID),
		Node:     get(HeaderNode),
		Reason:   get(HeaderReason),
		Message:  get(HeaderMessage),
		Severity: get(HeaderSeverity),
	}
	if ev.Node == "" {
		ev.Node, _ = strings.CutPrefix(get(HeaderSource), SourcePrefix)
	}
	if t := get(HeaderTime); t != "" {
		at, err := time.Parse(time.RFC3339Nano, t)
		if err != nil {
			return Event{}, fmt.Errorf("%w: %s event has ce-time %q, not RFC 3339", ErrMalformed, ceType, t)
		}
		ev.Time = at.UTC()
	}
	// Any involved-object header makes an object, as v1's "object" does (its readers check what they need).
	obj := ObjectRef{Kind: get(HeaderInvolvedKind), Namespace: get(HeaderInvolvedNS), Name: get(HeaderInvolvedName),
		UID: get(HeaderInvolvedUID), FieldPath: get(HeaderInvolvedField)}
	if obj != (ObjectRef{}) {
		ev.Object = &obj
	}
	if len(data) > 0 {
		if !json.Valid(data) {
			return Event{}, fmt.Errorf("%w: %s event %s: data is not JSON", ErrMalformed, ceType, ev.ID)
		}
		ev.Data = json.RawMessage(append([]byte(nil), data...))
	}
	if err := ev.Validate(); err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return ev, nil
}

// structuredEvent is why a structured-mode CloudEvent is refused as an event.
const structuredEvent = "body is a structured-mode CloudEvent; imagefleet events are binary mode: " +
	"the data as the body, the attributes in ce- headers (the CloudEvents NATS binding's binary mode)"
