package cri

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/imagefleet/imagefleet/internal/redact"
)

// Sentinels of the CRI boundary. Every error returned by Client wraps one of them where the gRPC code says
// something a caller acts on.
var (
	// ErrNotFound: the image or container does not exist (for a removal, "already gone" is success).
	ErrNotFound = errors.New("not found")
	// ErrUnavailable: the runtime cannot be reached (socket gone, runtime restarting).
	ErrUnavailable = errors.New("runtime unavailable")
	// ErrTimeout: the call did not finish within its timeout.
	ErrTimeout = errors.New("runtime call timed out")
	// ErrUnimplemented: the runtime does not implement the call.
	ErrUnimplemented = errors.New("not implemented by the runtime")
	// ErrInvalid: the runtime rejected the arguments.
	ErrInvalid = errors.New("invalid argument")
	// ErrPermission: authentication or authorization failed (registry credentials on pull).
	ErrPermission = errors.New("permission denied")
)

// CRI error messages that runtimes return as prefixes (k8s.io/cri-api/pkg/errors); the kubelet classifies
// pull errors by these prefixes because gRPC errors do not support errors.Is.
const (
	RegistryUnavailable       = "RegistryUnavailable"
	SignatureValidationFailed = "SignatureValidationFailed"
)

// mapErr converts a gRPC error from call op into an error wrapping a sentinel. It is the only place gRPC codes
// are interpreted.
func mapErr(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: %w: %v", op, ErrTimeout, err)
	}
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("%s: %w", op, err)
	}
	var sentinel error
	switch st.Code() {
	case codes.NotFound:
		sentinel = ErrNotFound
	case codes.Unavailable:
		sentinel = ErrUnavailable
	case codes.DeadlineExceeded:
		sentinel = ErrTimeout
	case codes.Unimplemented:
		sentinel = ErrUnimplemented
	case codes.InvalidArgument:
		sentinel = ErrInvalid
	case codes.PermissionDenied, codes.Unauthenticated:
		sentinel = ErrPermission
	}
	// containerd answers a missing image with Unknown and "not found" text on some paths.
	if sentinel == nil && strings.Contains(strings.ToLower(st.Message()), "not found") {
		sentinel = ErrNotFound
	}
	// The runtime's own text, without any credential it quoted (a registry URL with user:password, a token).
	msg := redact.Secrets(st.Message())
	if sentinel == nil {
		return &Error{Op: op, Message: msg}
	}
	return &Error{Op: op, Message: msg, Kind: sentinel}
}

// Error is a runtime error: the operation, the runtime's own message (as the kubelet shows it) and, when the
// gRPC code said something actionable, the sentinel it wraps.
type Error struct {
	Op      string
	Message string
	Kind    error
}

func (e *Error) Error() string {
	if e.Kind != nil {
		return fmt.Sprintf("%s: %v: %s", e.Op, e.Kind, e.Message)
	}
	return fmt.Sprintf("%s: %s", e.Op, e.Message)
}

// Unwrap returns the sentinel.
func (e *Error) Unwrap() error { return e.Kind }

// RuntimeMessage is the runtime's own message of err (the gRPC status message), as the kubelet puts it in its
// events; for other errors, err.Error().
func RuntimeMessage(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Message
	}
	return err.Error()
}
