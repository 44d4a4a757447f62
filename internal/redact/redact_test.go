package redact

import "testing"

func TestSecrets(t *testing.T) {
	cases := []struct{ in, want string }{
		{`Pulling image "r.example/app:1"`, `Pulling image "r.example/app:1"`},
		{`Successfully pulled image "a:1" in 1.2s (1.2s including waiting). Image size: 123 bytes.`, `Successfully pulled image "a:1" in 1.2s (1.2s including waiting). Image size: 123 bytes.`},
		{`dial https://user:s3cr3t@reg:5000/v2/`, `dial https://REDACTED@reg:5000/v2/`},
		{`header Authorization: Basic dXNlcjpwYXNz`, `header Authorization: Basic REDACTED`},
		{`got Bearer eyJhbGciOiJSUzI1NiJ9.abcdefgh`, `got Bearer REDACTED`},
		{`GET /token?scope=x&access_token=abc123&x=1`, `GET /token?scope=x&access_token=REDACTED&x=1`},
		{`{"auth":"dXNlcjpwYXNz","password":"p"}`, `{"auth":"REDACTED","password":"REDACTED"}`},
		{`image "r.example/app@sha256:0123": not found`, `image "r.example/app@sha256:0123": not found`},
		{`failed to fetch oauth token: unexpected status: 401 Unauthorized`, `failed to fetch oauth token: unexpected status: 401 Unauthorized`},
		{`{"auths":{"r":{"auth": "dXNlcjpwYXNz"}}}`, `{"auths":{"r":{"auth": "REDACTED"}}}`},
	}
	for _, c := range cases {
		if got := Secrets(c.in); got != c.want {
			t.Errorf("Secrets(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
