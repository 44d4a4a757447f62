package events

import "errors"

// Error codes of replies. A request/reply handler's error travels as text (Reply.Error) and, when it wraps
// one of the sentinels below, as a code in the reply's HeaderErrorCode header; bus.Request maps the code back
// to the sentinel, so a caller tests errors.Is(err, events.ErrIndexCatchingUp), never the text. This table
// is the one place codes and sentinels meet. A reply without the header (an agent older than the codes) is
// a plain remote error.
const (
	// HeaderErrorCode is the reply header that carries the error's code.
	HeaderErrorCode = "imagefleet-error-code"

	CodeMalformed       = "malformed"         // ErrMalformed
	CodeIndexCatchingUp = "index-catching-up" // ErrIndexCatchingUp
	CodePartsMissing    = "parts-missing"     // ErrPartsMissing
)

// ErrIndexCatchingUp is the pod index's answer to queries until it has applied the events its stream held
// when it started: a state without them could say a pod is absent (so its images unused) when it is not.
// Callers wait and ask again.
var ErrIndexCatchingUp = errors.New("the pod index is catching up with its events")

// ErrPartsMissing is the partitioned inventory's answer when the parts it gathered do not cover every
// partition in time: a partition is being taken over by another replica (seconds), or no replica holds it.
// Callers wait and ask again.
var ErrPartsMissing = errors.New("the inventory's partitions are not all answered")

var errorCodes = []struct {
	code string
	err  error
}{
	{CodeIndexCatchingUp, ErrIndexCatchingUp},
	{CodeMalformed, ErrMalformed},
	{CodePartsMissing, ErrPartsMissing},
}

// ErrorCode is the code of err: that of the first sentinel of the table err wraps ("" for none).
func ErrorCode(err error) string {
	for _, c := range errorCodes {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return ""
}

// CodeError is the sentinel of code (nil for an unknown code, such as one a newer agent sends).
func CodeError(code string) error {
	for _, c := range errorCodes {
		if c.code == code {
			return c.err
		}
	}
	return nil
}
