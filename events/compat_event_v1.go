// Compatibility path: event type v1 (imagefleet.<entity>.<action>.v1).
//
// A v1 event's body is the whole Event envelope as JSON (type, id, time, node, reason, message, severity,
// object, data) and its headers are CloudEventHeader's; v2 carries the payload alone as the body and the
// envelope in ce- headers (wire.go, docs/events.md). v1 is still the agents' default writer version
// (--event-version), and every reader reads both: EncodeEvent writes a v1 type with encodeV1, and
// DecodeEventMsg reads a message without a ce-type of another version with decodeV1Msg.
//
// Remove when: v1's end of support (docs/events.md; docs/upgrading.md, "Compatibility paths"). The refusal of
// a structured-mode CloudEvent in decodeV1Msg stays with the reader.

package events

import (
	"encoding/json"
	"fmt"
	"strings"
)

// encodeV1 is a v1 event as on the wire: the CloudEvents headers and the envelope as the body.
func encodeV1(ev Event) (map[string]string, []byte, error) {
	body, err := json.Marshal(ev)
	if err != nil {
		return nil, nil, fmt.Errorf("marshal event %s: %w", ev.ID, err)
	}
	return CloudEventHeader(ev.Type, ev.ID, ev.Node, ev.Time), body, nil
}

// decodeV1Msg decodes a message whose ce-type (ceType) is v1, missing or not a type: its body is a v1
// envelope (DecodeEvent), whose type must be ceType when that is set. A structured-mode CloudEvent is
// refused.
func decodeV1Msg(header map[string][]string, data []byte, ceType string) (Event, error) {
	if strings.HasPrefix(headerGet(header, HeaderContentType), "application/cloudevents") ||
		strings.HasPrefix(headerGet(header, HeaderDataContentType), "application/cloudevents") {
		return Event{}, fmt.Errorf("%w: %s", ErrMalformed, structuredEvent)
	}
	ev, err := DecodeEvent(data)
	if err != nil {
		if ceType == "" && isStructuredCloudEvent(data) {
			return Event{}, fmt.Errorf("%w: %s", ErrMalformed, structuredEvent)
		}
		return Event{}, err
	}
	if ceType != "" && ceType != ev.Type {
		return Event{}, fmt.Errorf("%w: ce-type %q does not match the body's type %q", ErrMalformed, ceType, ev.Type)
	}
	return ev, nil
}
