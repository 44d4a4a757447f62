// Package redact removes credentials from text that reaches events, logs and Kubernetes Events.
package redact

import "regexp"

// A runtime's pull error can quote what it was given: a registry URL with user and password, an
// Authorization header, a token parameter. The kubelet posts the runtime's text as it is; imagefleet removes
// these where the runtime's text enters (services/cri's error mapping), so no event, result, record or log
// line carries them, and again before a Kubernetes Event (readable by anyone who may list events).
var redactions = []struct {
	re   *regexp.Regexp
	repl string
}{
	// scheme://user:password@host
	{regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@`), "${1}REDACTED@"},
	// Authorization: Basic xxx / Bearer xxx
	{regexp.MustCompile(`(?i)\b((?:proxy-)?authorization:?\s*(?:basic|bearer)\s+)[A-Za-z0-9+/=._~-]+`), "${1}REDACTED"},
	{regexp.MustCompile(`(?i)\b(basic|bearer)\s+[A-Za-z0-9+/=._~-]{16,}`), "${1} REDACTED"},
	// password=..., access_token=... (a query or a form), and "auth":"...", "password": "..." (JSON). A
	// "token: ..." in prose ("failed to fetch oauth token: unexpected status") is the runtime's sentence, not
	// a credential, and stays.
	{regexp.MustCompile(`(?i)\b((?:password|passwd|secret|auth|token|access_token|refresh_token|identitytoken|registrytoken|x-amz-security-token|x-amz-signature|signature)=)[^\s"'&,;:}]+`), "${1}REDACTED"},
	{regexp.MustCompile(`(?i)("(?:password|passwd|secret|auth|token|access_token|refresh_token|identitytoken|registrytoken)"\s*:\s*")[^"]*`), "${1}REDACTED"},
}

// Secrets removes credentials from a message, leaving the rest of its text as it was.
func Secrets(msg string) string {
	for _, r := range redactions {
		msg = r.re.ReplaceAllString(msg, r.repl)
	}
	return msg
}
