package bus

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// statusFails is a bucket whose status cannot be read (the JetStream API timed out); only Status is called.
type statusFails struct{ jetstream.KeyValue }

func (statusFails) Status(context.Context) (jetstream.KeyValueStatus, error) {
	return nil, context.DeadlineExceeded
}

// TestBucketStatusErrorIsNoMismatch: a status read that times out is an error (KV retries it), not settings
// that differ: at 10,000 nodes each such read was followed by an update request and a misleading "bucket kept
// with its existing settings" warning (docs/scale.md).
func TestBucketStatusErrorIsNoMismatch(t *testing.T) {
	matches, _, err := bucketMatches(t.Context(), statusFails{}, &jetstream.KeyValueConfig{Bucket: "b", History: 1})
	if !errors.Is(err, context.DeadlineExceeded) || matches {
		t.Fatalf("bucketMatches with a status timing out = %v, %v; want false, %v", matches, err, context.DeadlineExceeded)
	}
	if !IsTransient(err) {
		t.Fatalf("a status timing out is not transient, so KV would not retry it: %v", err)
	}
}
