package bus

import (
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestIsTransientDuplicateInProcess: the stream leader's "duplicate message id is in process" (an earlier
// attempt with the same Nats-Msg-Id not yet stored) is worth a retry; a wrong last sequence is not.
func TestIsTransientDuplicateInProcess(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"duplicate in process", fmt.Errorf("publish: %w", &jetstream.APIError{Code: 409, ErrorCode: 10158, Description: "duplicate message id is in process"}), true},
		{"wrong last sequence", fmt.Errorf("publish: %w", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence}), false},
		{"unavailable", &jetstream.APIError{Code: 503, ErrorCode: 10008}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := IsTransient(tc.err); got != tc.want {
				t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}
