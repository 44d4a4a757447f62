package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the golden files")

var goldenTime = time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)

// goldenCases are one of each message this package defines, with every field set. A changed golden file is a
// schema change: additive changes are fine (update with -update); removals and renames need a new type version.
func goldenCases() map[string]any {
	high, low := 90, 80
	return map[string]any{
		"event_image_removed": Event{Type: TypeName(EntityImage, ActionRemoved), ID: "0123456789abcdef", Time: goldenTime, Node: "node-1.example",
			Data: json.RawMessage(`{"id":"sha256:aa","repoTags":["docker.io/library/nginx:1.27"],"size":1024,"reason":"space"}`)},
		"event_node_warning": Event{Type: TypeName(EntityNode, ActionWarning), ID: "fedcba9876543210", Time: goldenTime, Node: "node-1",
			Reason: "FreeDiskSpaceFailed", Severity: Warning, Object: &ObjectRef{Kind: "Node", Name: "node-1"},
			Message: "Insufficient free disk space on the node's image filesystem (95% of 10.0 GiB used). Failed to free sufficient space by deleting unused images (freed 524288000 bytes). Investigate disk usage, as it could be used by active images, logs, volumes, or other data."},
		"image_record": ImageRecord{ID: "sha256:aa", RepoTags: []string{"docker.io/library/nginx:1.27"}, RepoDigests: []string{"docker.io/library/nginx@sha256:bb"},
			Size: 1024, Pinned: true, InUse: true, FirstDetected: goldenTime, LastUsed: goldenTime.Add(time.Minute)},
		"gc_request": GCRequest{ID: "gc-lab.node-1", DryRun: true, AllUnused: true, HighThresholdPercent: &high, LowThresholdPercent: &low,
			MinAge: &Duration{2 * time.Minute}, MaxAge: &Duration{time.Hour}},
		"gc_result": GCResult{Node: "node-1", DryRun: false, CapacityBytes: 1000, AvailableBytes: 50, UsagePercent: 95, AmountToFree: 150,
			FreedBytes: 450, Removed: []GCRemoved{{ID: "image-0", Size: 450, Reason: "space"}}, Skipped: []GCSkipped{{ID: "image-1", Why: "in use"}},
			Started: goldenTime, Duration: Duration{1500 * time.Millisecond}},
		"detect_reply": DetectReply{Node: "node-1", Time: goldenTime, Records: 3, InUse: 1, Added: 1, Removed: 0, Duration: Duration{time.Millisecond}},
		"images_reply": ImagesReply{Node: "node-1", Refreshed: goldenTime, Images: []Image{{ID: "sha256:aa", RepoTags: []string{"a:1"}, Size: 10}}},
		"inuse_reply":  InUseReply{Node: "node-1", Images: []string{"nginx:1.27"}},
	}
}

func TestGoldenRoundTrip(t *testing.T) {
	for name, v := range goldenCases() {
		t.Run(name, func(t *testing.T) {
			got, err := json.MarshalIndent(v, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, '\n')
			path := filepath.Join("testdata", name+".json")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test ./events -update to create it)", err)
			}
			if string(got) != string(want) {
				t.Fatalf("%s changed:\n got %s\nwant %s", path, got, want)
			}
			// Decoding the golden file and encoding it again gives the same bytes: no field is lost.
			ptr := newOfSameType(v)
			if err := json.Unmarshal(want, ptr); err != nil {
				t.Fatal(err)
			}
			again, _ := json.MarshalIndent(ptr, "", "  ")
			if string(append(again, '\n')) != string(want) {
				t.Fatalf("round trip of %s lost data:\n%s", path, again)
			}
		})
	}
}

func newOfSameType(v any) any {
	switch v.(type) {
	case Event:
		return &Event{}
	case ImageRecord:
		return &ImageRecord{}
	case GCRequest:
		return &GCRequest{}
	case GCResult:
		return &GCResult{}
	case DetectReply:
		return &DetectReply{}
	case ImagesReply:
		return &ImagesReply{}
	case InUseReply:
		return &InUseReply{}
	}
	panic("add the type to newOfSameType")
}

func TestNodeToken(t *testing.T) {
	for _, n := range []string{"node-1", "ip-10-0-0-1.ec2.internal", "a"} {
		if err := ValidateNodeName(n); err != nil {
			t.Fatal(err)
		}
		tok := NodeToken(n)
		if strings.Contains(tok, ".") || NodeFromToken(tok) != n {
			t.Errorf("NodeToken(%q) = %q, back %q", n, tok, NodeFromToken(tok))
		}
	}
	for _, bad := range []string{"", "Node", "a_b", "a..b", "-a", "a*", "a>", strings.Repeat("a", 254)} {
		if ValidateNodeName(bad) == nil {
			t.Errorf("ValidateNodeName(%q) accepted", bad)
		}
	}
	if got := EventSubject("n.a", EntityImage, ActionRemoved); got != "imagefleet.evt.n_a.image.removed" {
		t.Errorf("EventSubject = %s", got)
	}
}

func TestGCRequestValidationUsesKubeletMessages(t *testing.T) {
	for body, want := range map[string]string{
		`{"highThresholdPercent":101}`: "invalid HighThresholdPercent 101, must be in range [0-100]",
		`{"highThresholdPercent":-1}`:  "invalid HighThresholdPercent -1, must be in range [0-100]",
		`{"lowThresholdPercent":-1}`:   "invalid LowThresholdPercent -1, must be in range [0-100]",
		`{"minAge":"-1s"}`:             "imageMinimumGCAge -1s must not be negative",
		`{"maxAge":"-1m"}`:             "imageMaximumGCAge -1m0s must not be negative",
		`{"maxAge":"soon"}`:            `invalid duration "soon"`,
		`{"dryRun":"yes"}`:             `field "dryRun" must be bool, not string`,
		`{"dryRun":true} {}`:           "trailing data",
		`{"dryRun":true,"x":1}`:        `unknown field "x"`,
	} {
		var r GCRequest
		err := DecodeStrict([]byte(body), &r)
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", body, err, want)
		}
	}
	var r GCRequest
	if err := DecodeStrict(nil, &r); err != nil || r.DryRun {
		t.Errorf("empty body: %v %+v", err, r)
	}
	if err := DecodeStrict(make([]byte, MaxMessageBytes+1), &r); err == nil || !strings.Contains(err.Error(), "over the limit") {
		t.Errorf("oversized: %v", err)
	}
}

func TestDecodeEventRejectsBadEnvelopes(t *testing.T) {
	for body, want := range map[string]string{
		`{"type":"nope","id":"1","time":"2026-01-01T00:00:00Z","node":"n"}`:                                         "not of the form",
		`{"type":"imagefleet.image.removed.v1","time":"2026-01-01T00:00:00Z","node":"n"}`:                           "has no id",
		`{"type":"imagefleet.image.removed.v1","id":"1","node":"n"}`:                                                "has no time",
		`{"type":"imagefleet.image.removed.v1","id":"1","time":"2026-01-01T00:00:00Z","node":"N"}`:                  "DNS-1123",
		`{"type":"imagefleet.image.removed.v1","id":"1","time":"2026-01-01T00:00:00Z","node":"n","severity":"Bad"}`: "neither Normal nor Warning",
		`[]`: "malformed",
	} {
		if _, err := DecodeEvent([]byte(body)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", body, err, want)
		}
	}
}

// FuzzDecode feeds arbitrary bytes to every decoder: none may panic, and what decodes must validate.
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{`{}`, `{"dryRun":true,"minAge":"2m"}`, `{"time":"2026-01-01T00:00:00+00:00"}`, `{"type":"imagefleet.image.removed.v1","id":"1","time":"2026-01-01T00:00:00Z","node":"n"}`, `{"limit":5}`, `{`, `null`,
		`{"uid":"u","limit":2}`, `{"namespace":"ns","name":"p"}`, `{"orphaned":true,"uid":"u"}`,
		`{"what":"where","image":"nginx"}`, `{"what":"nodes","limit":-1}`, `{"podUID":"u"}`, `{"requestID":""}`} {
		f.Add([]byte(seed))
	}
	// Every body a worker decodes strictly: an accepted one is valid, a rejected one says malformed.
	strict := map[string]func() any{
		"GCRequest": func() any { return &GCRequest{} }, "QueryRequest": func() any { return &QueryRequest{} },
		"DetectRequest": func() any { return &DetectRequest{} }, "PodsQuery": func() any { return &PodsQuery{} },
		"InventoryQuery": func() any { return &InventoryQuery{} }, "PullCancel": func() any { return &PullCancel{} },
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		blank := len(bytes.TrimSpace(data)) == 0
		for name, fresh := range strict {
			v := fresh()
			err := DecodeStrict(data, v)
			if err != nil {
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("%s: error %v does not wrap ErrMalformed", name, err)
				}
				continue
			}
			// What it accepts is valid JSON that the standard decoder reads to the same value (DecodeStrict
			// is built on encoding/json today: a guard should that change), and the value's encoding is
			// accepted again and encodes the same (bytes compared: a time's zone may change on the way).
			if !blank {
				if !json.Valid(data) {
					t.Fatalf("%s: accepted invalid JSON %q", name, data)
				}
				plain := fresh()
				if err := json.Unmarshal(data, plain); err != nil {
					t.Fatalf("%s: accepted %q that encoding/json rejects: %v", name, data, err)
				}
				if !reflect.DeepEqual(plain, v) {
					t.Fatalf("%s: %q decodes to %+v, encoding/json reads %+v", name, data, v, plain)
				}
			}
			again, err := json.Marshal(v)
			if err != nil {
				t.Fatalf("%s: cannot encode the accepted value %+v: %v", name, v, err)
			}
			back := fresh()
			if err := DecodeStrict(again, back); err != nil {
				t.Fatalf("%s: rejects its own encoding %s of accepted %q: %v", name, again, data, err)
			}
			if twice, _ := json.Marshal(back); !bytes.Equal(again, twice) {
				t.Fatalf("%s: round trip changed the value: %s, then %s", name, again, twice)
			}
		}
		ev, err := DecodeEvent(data)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("event: error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if !json.Valid(data) {
			t.Fatalf("event: accepted invalid JSON %q", data)
		}
		first, err := json.Marshal(ev)
		if err != nil {
			t.Fatalf("event: cannot encode accepted %q: %v", data, err)
		}
		back, err := DecodeEvent(first)
		if err != nil {
			t.Fatalf("event: rejects its own encoding %s of accepted %q: %v", first, data, err)
		}
		if second, _ := json.Marshal(back); !bytes.Equal(first, second) {
			t.Fatalf("event: round trip changed the event: %s, then %s", first, second)
		}
	})
}
