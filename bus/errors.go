package bus

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrStreamLimit means a stream refused a message because a limit with discard-new is reached (for example
// the pull stream's messages per subject). It is decided by the JetStream API error code, never by the
// server's text.
var ErrStreamLimit = errors.New("stream limit reached")

// jsStoreFailed is the JetStream API error code of a message the stream refused to store
// (JSStreamStoreFailedF, 10077): a discard-new limit (messages, bytes, messages per subject) or a message
// over the stream's maximum size. nats.go names no constant for it.
const jsStoreFailed jetstream.ErrorCode = 10077

// mapJetStream maps a JetStream API error to this package's sentinels, keeping the server's error in the
// chain. It is the one place JetStream error codes become sentinels.
func mapJetStream(err error) error {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return err
	}
	switch apiErr.ErrorCode {
	case jsStoreFailed:
		return fmt.Errorf("%w: %w", ErrStreamLimit, err)
	}
	return err
}
