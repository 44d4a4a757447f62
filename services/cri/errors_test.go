package cri

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestMapErrKeepsNoCredential: the runtime's text enters imagefleet here, and from here reaches pull events,
// results, backoff records and logs: a credential it quotes is removed, the rest of its text (the kubelet
// classifies pull errors by its prefixes) and its sentinel are kept.
func TestMapErrKeepsNoCredential(t *testing.T) {
	cases := []struct {
		code     codes.Code
		msg      string
		want     string
		sentinel error
	}{
		{codes.Unknown, `failed to pull and unpack image "r:5000/app:1": failed to resolve reference: pull access denied, https://bob:hunter2@r:5000/v2/: 401`,
			`failed to pull and unpack image "r:5000/app:1": failed to resolve reference: pull access denied, https://REDACTED@r:5000/v2/: 401`, nil},
		{codes.Unauthenticated, `fetch token: GET https://auth.example/token?scope=repo&access_token=abc123: 401`,
			`fetch token: GET https://auth.example/token?scope=repo&access_token=REDACTED: 401`, ErrPermission},
		{codes.Unknown, RegistryUnavailable + `: dial tcp 10.0.0.1:5000: connection refused`,
			RegistryUnavailable + `: dial tcp 10.0.0.1:5000: connection refused`, nil},
	}
	for _, c := range cases {
		err := mapErr("pull image", status.Error(c.code, c.msg))
		var e *Error
		if !errors.As(err, &e) {
			t.Fatalf("mapErr(%q) = %T %v, want *Error", c.msg, err, err)
		}
		if e.Message != c.want {
			t.Errorf("message = %q, want %q", e.Message, c.want)
		}
		if strings.Contains(err.Error(), "hunter2") || strings.Contains(err.Error(), "abc123") {
			t.Errorf("error text keeps a credential: %v", err)
		}
		if c.sentinel != nil && !errors.Is(err, c.sentinel) {
			t.Errorf("mapErr(%v) = %v, want it to wrap %v", c.code, err, c.sentinel)
		}
	}
}
