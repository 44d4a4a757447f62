package puller

import (
	"encoding/base64"
	"strings"
	"testing"
)

// FuzzParseDockerConfig: a pull secret or node keyring of any content never panics the puller; a parsed
// "auth" field splits into the user and password it was made from.
func FuzzParseDockerConfig(f *testing.F) {
	f.Add([]byte(`{"auths":{"registry.example":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("user:pa:ss")) + `"}}}`))
	f.Add([]byte(`{"registry.example":{"username":"u","password":"p"}}`))
	f.Add([]byte(`{"auths":{"r":{"auth":"bm9jb2xvbg"}}}`))
	f.Add([]byte(`{"auths":null}`))
	f.Add([]byte(`[1,2,3]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		entries, err := parseDockerConfig(data)
		if err != nil {
			return
		}
		for _, e := range entries {
			if e.Auth == "" {
				continue
			}
			user, pass, err := decodeAuthField(e.Auth)
			if err != nil {
				continue
			}
			again, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(e.Auth, "="))
			if err == nil && string(again) != user+":"+pass {
				t.Fatalf("auth %q split into %q and %q", e.Auth, user, pass)
			}
		}
	})
}
