package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxMessageBytes is the largest request body a worker accepts (the NATS default max_payload).
const MaxMessageBytes = 1 << 20

// Validator is a message that can check itself after decoding.
type Validator interface{ Validate() error }

// ErrMalformed marks a message that can never be processed: redelivering it cannot help.
var ErrMalformed = errors.New("malformed message")

// DecodeStrict decodes a command or query body: one JSON object, no unknown fields, no trailing data, at most
// MaxMessageBytes, then Validate when v has it. Every error wraps ErrMalformed and says what is wrong.
// An empty body decodes as {} (so commands with all-default options may be sent empty).
func DecodeStrict(data []byte, v any) error {
	if len(data) > MaxMessageBytes {
		return fmt.Errorf("%w: body of %d bytes is over the limit of %d", ErrMalformed, len(data), MaxMessageBytes)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		data = []byte("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: %s", ErrMalformed, describeJSONError(err))
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: trailing data after the JSON object", ErrMalformed)
	}
	if val, ok := v.(Validator); ok {
		if err := val.Validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrMalformed, err)
		}
	}
	return nil
}

func describeJSONError(err error) string {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		return fmt.Sprintf("field %q must be %s, not %s", typeErr.Field, typeErr.Type, typeErr.Value)
	case errors.As(err, &syntaxErr):
		return fmt.Sprintf("invalid JSON at offset %d: %v", syntaxErr.Offset, syntaxErr)
	default:
		return err.Error()
	}
}

// DecodeEvent decodes and validates an event envelope (lenient about unknown fields: events evolve additively):
// a v1 message's body, a journal line, `imagefleet events -o json` output. A message read from NATS may be v2,
// whose body is the payload alone: decode those with DecodeEventMsg, which reads both versions.
func DecodeEvent(data []byte) (Event, error) {
	if len(data) > MaxMessageBytes {
		return Event{}, fmt.Errorf("%w: event of %d bytes is over the limit of %d", ErrMalformed, len(data), MaxMessageBytes)
	}
	var ev Event
	if err := json.Unmarshal(data, &ev); err != nil {
		return Event{}, fmt.Errorf("%w: %s", ErrMalformed, describeJSONError(err))
	}
	if err := ev.Validate(); err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return ev, nil
}

// Reply is the envelope of every request/reply answer: exactly one of Error or Data is set.
type Reply struct {
	Error string          `json:"error,omitempty"`
	Data  json.RawMessage `json:"data,omitempty"`
}
