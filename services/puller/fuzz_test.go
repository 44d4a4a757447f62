package puller

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/imagefleet/imagefleet/events"
)

// FuzzDecodePullRequest: no body crashes the decoder; what it accepts is valid and survives a round trip;
// what it refuses is marked malformed (so the consumer terminates it as a dead letter).
func FuzzDecodePullRequest(f *testing.F) {
	for _, s := range []string{
		`{"id":"r1","image":"busybox","policy":"Always"}`,
		`{"id":"r2","image":"registry.local:5000/app@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","pod":{"namespace":"ns","name":"p","uid":"u"},"secrets":["regcred"]}`,
		`{"id":"r3","image":"FAILED_IMAGE","annotations":{"a":"b"},"enqueued":"2026-07-22T10:00:00Z"}`,
		`{"id":"","image":""}`, `[]`, `{"id":"r4","image":"x","policy":"Sometimes"}`, `{"id":"r5"} {}`, ``, `{"id":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := DecodePullRequest(data)
		if err != nil {
			if !errors.Is(err, events.ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if err := req.Validate(); err != nil {
			t.Fatalf("accepted an invalid request: %v", err)
		}
		raw, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		again, err := DecodePullRequest(raw)
		if err != nil {
			t.Fatalf("round trip of %s: %v", raw, err)
		}
		if again.ID != req.ID || again.Image != req.Image || again.Policy != req.Policy {
			t.Fatalf("round trip changed the request: %+v != %+v", again, req)
		}
		// The manager must not crash on any accepted image either.
		_ = defaultPullPolicy(req.Image)
		_, _ = applyDefaultImageTag(req.Image)
	})
}
