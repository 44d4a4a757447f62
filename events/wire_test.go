package events

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// wireText is a message as its golden file holds it: the headers, one "name: value" a line in name order,
// a blank line, then the body.
func wireText(h map[string]string, body []byte) []byte {
	var b bytes.Buffer
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range h {
			if !yield(k) {
				return
			}
		}
	}) {
		fmt.Fprintf(&b, "%s: %s\n", k, h[k])
	}
	b.WriteString("\n")
	b.Write(body)
	b.WriteString("\n")
	return b.Bytes()
}

func natsHeader(h map[string]string) map[string][]string {
	out := make(map[string][]string, len(h))
	for k, v := range h {
		out[k] = []string{v}
	}
	return out
}

// TestGoldenV2 pins the v2 wire format of every event case: headers and body. A changed file is a change
// of the v2 contract.
func TestGoldenV2(t *testing.T) {
	for name, v := range goldenCases() {
		ev, ok := v.(Event)
		if !ok {
			continue
		}
		t.Run(name, func(t *testing.T) {
			v2, err := ev.AsVersion(V2)
			if err != nil {
				t.Fatal(err)
			}
			h, body, err := EncodeEvent(v2)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(body, ev.Data) {
				t.Fatalf("v2 body %q, want the payload alone %q", body, ev.Data)
			}
			got := wireText(h, body)
			path := filepath.Join("testdata", name+".v2.golden")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test ./events -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("v2 wire of %s changed:\n%s\nwant:\n%s", name, got, want)
			}
			back, err := DecodeEventMsg(natsHeader(h), body)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, v2) {
				t.Fatalf("v2 round trip: got %+v, want %+v", back, v2)
			}
		})
	}
}

// TestDecodeEventMsgReadsBothVersions: the v1 message (envelope body, its headers) and the v2 message of the
// same event decode to the same event but for the type's version.
func TestDecodeEventMsgReadsBothVersions(t *testing.T) {
	for name, v := range goldenCases() {
		ev, ok := v.(Event)
		if !ok {
			continue
		}
		h1, b1, err := EncodeEvent(ev)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := h1[HeaderContentType]; !ok || h1[HeaderType] != ev.Type {
			t.Fatalf("%s: v1 headers %v changed", name, h1)
		}
		got1, err := DecodeEventMsg(natsHeader(h1), b1)
		if err != nil {
			t.Fatalf("%s v1: %v", name, err)
		}
		// A v1 message without headers (published by an older client) is read from its body.
		got0, err := DecodeEventMsg(nil, b1)
		if err != nil || !reflect.DeepEqual(got0, got1) {
			t.Fatalf("%s v1 without headers: %+v, %v", name, got0, err)
		}
		v2, _ := ev.AsVersion(V2)
		h2, b2, err := EncodeEvent(v2)
		if err != nil {
			t.Fatal(err)
		}
		got2, err := DecodeEventMsg(natsHeader(h2), b2)
		if err != nil {
			t.Fatalf("%s v2: %v", name, err)
		}
		if got2.Version() != V2 || got1.Version() != V1 {
			t.Fatalf("%s: versions %q and %q", name, got1.Version(), got2.Version())
		}
		got2.Type = got1.Type
		if !reflect.DeepEqual(got1, got2) {
			t.Fatalf("%s: v1 reads %+v, v2 reads %+v", name, got1, got2)
		}
		entity, action, _, _ := ParseType(ev.Type)
		if !got1.Is(entity, action) || !got2.Is(entity, action) || got2.Is(entity, "other") {
			t.Fatalf("%s: Is does not match across versions", name)
		}
	}
}

func TestDecodeEventMsgRefuses(t *testing.T) {
	ok := map[string]string{HeaderSpecVersion: "1.0", HeaderType: "imagefleet.image.removed.v2", HeaderSource: SourcePrefix + "n1",
		HeaderID: "abc", HeaderTime: "2026-11-22T10:00:00Z", HeaderDataContentType: "application/json", HeaderNode: "n1"}
	with := func(k, v string) map[string][]string {
		h := natsHeader(ok)
		if v == "" {
			delete(h, k)
		} else {
			h[k] = []string{v}
		}
		return h
	}
	if _, err := DecodeEventMsg(natsHeader(ok), []byte(`{"id":"sha256:aa"}`)); err != nil {
		t.Fatalf("the valid v2 message is refused: %v", err)
	}
	// An object named in part is read as v1's is: its readers check what they need.
	if ev, err := DecodeEventMsg(with(HeaderInvolvedKind, "Pod"), []byte(`{}`)); err != nil || ev.Object == nil || *ev.Object != (ObjectRef{Kind: "Pod"}) {
		t.Fatalf("partial object: %+v, %v", ev.Object, err)
	}
	cases := []struct {
		name   string
		header map[string][]string
		body   string
		want   string
	}{
		{"no id", with(HeaderID, ""), `{}`, "has no id"},
		{"no time", with(HeaderTime, ""), `{}`, "has no time"},
		{"bad time", with(HeaderTime, "yesterday"), `{}`, "not RFC 3339"},
		{"spec 0.3", with(HeaderSpecVersion, "0.3"), `{}`, `ce-specversion "0.3"`},
		{"xml", with(HeaderDataContentType, "application/xml"), `{}`, "want application/json"},
		{"not json", natsHeader(ok), `{"id":`, "data is not JSON"},
		{"bad severity", with(HeaderSeverity, "Fatal"), `{}`, "neither Normal nor Warning"},
		{"v3", with(HeaderType, "imagefleet.image.removed.v3"), `{}`, "version this release does not read"},
		{"pod", with(HeaderType, "imagefleet.pod.added.v2"), `{}`, "pod event"},
		{"structured", map[string][]string{HeaderContentType: {"application/cloudevents+json"}}, `{"specversion":"1.0","type":"imagefleet.image.removed.v2","id":"x","source":"s"}`, "structured-mode"},
		{"structured without headers", nil, `{"specversion":"1.0","type":"imagefleet.image.removed.v2","id":"x","source":"s"}`, "structured-mode"},
		{"v1 type mismatch", map[string][]string{HeaderType: {"imagefleet.image.vanished.v1"}}, `{"type":"imagefleet.image.removed.v1","id":"a","time":"2026-11-22T10:00:00Z","node":"n1"}`, "does not match"},
	}
	for _, c := range cases {
		_, err := DecodeEventMsg(c.header, []byte(c.body))
		if err == nil || !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want ErrMalformed with %q", c.name, err, c.want)
		}
	}
}

// TestEncodeV2HeaderSafe: a message with a line break travels in one header line and decodes as sent
// but for the break, which becomes a space.
func TestEncodeV2HeaderSafe(t *testing.T) {
	ev, err := New("n1", EntityNode, ActionWarning, nil)
	if err != nil {
		t.Fatal(err)
	}
	ev = ev.WithKube(Warning, "FreeDiskSpaceFailed", "first line\r\nsecond\tline ", &ObjectRef{Kind: "Node", Name: "n1"})
	v2, _ := ev.AsVersion(V2)
	h, body, err := EncodeEvent(v2)
	if err != nil {
		t.Fatal(err)
	}
	if got := h[HeaderMessage]; got != "first line  second line" {
		t.Fatalf("ce-message %q", got)
	}
	if len(body) != 0 {
		t.Fatalf("an event without data has body %q", body)
	}
	back, err := DecodeEventMsg(natsHeader(h), body)
	if err != nil {
		t.Fatal(err)
	}
	if back.Reason != "FreeDiskSpaceFailed" || back.Severity != Warning || back.Object.Kind != "Node" || back.Data != nil {
		t.Fatalf("decoded %+v", back)
	}
}

// FuzzDecodeEventMsg: any headers and body either decode to an event that encodes back to a message
// decoding to the same event, or fail with ErrMalformed; nothing panics.
func FuzzDecodeEventMsg(f *testing.F) {
	f.Add("imagefleet.image.removed.v2", "abc", "2026-11-22T10:00:00Z", "n1", "Warning", "Pod", "p", `{"id":"sha256:aa"}`)
	f.Add("imagefleet.node.warning.v2", "abc", "2026-11-22T10:00:00.5+02:00", "", "", "", "", ``)
	f.Add("", "", "", "", "", "", "", `{"type":"imagefleet.image.removed.v1","id":"a","time":"2026-11-22T10:00:00Z","node":"n1"}`)
	f.Add("imagefleet.pod.added.v2", "x", "", "n1", "", "", "", `{}`)
	f.Fuzz(func(t *testing.T, typ, id, at, node, severity, kind, name, body string) {
		h := map[string][]string{}
		for k, v := range map[string]string{HeaderSpecVersion: "1.0", HeaderType: typ, HeaderID: id, HeaderTime: at, HeaderNode: node,
			HeaderSeverity: severity, HeaderInvolvedKind: kind, HeaderInvolvedName: name, HeaderDataContentType: "application/json"} {
			if v != "" {
				h[k] = []string{v}
			}
		}
		ev, err := DecodeEventMsg(h, []byte(body))
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		eh, eb, err := EncodeEvent(ev)
		if err != nil {
			if ev.Version() != V1 && ev.Version() != V2 {
				return // a v1 envelope body may name another version; it is read, not written
			}
			t.Fatalf("accepted %+v does not encode: %v", ev, err)
		}
		back, err := DecodeEventMsg(natsHeader(eh), eb)
		if err != nil {
			t.Fatalf("its own encoding of %+v is refused: %v", ev, err)
		}
		if back.Version() == V2 && !reflect.DeepEqual(back, ev) {
			t.Fatalf("v2 round trip: %+v, then %+v", ev, back)
		}
	})
}
