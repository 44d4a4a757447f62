package main

import (
	"bytes"
	"encoding/json"
	"testing"
)

// TestJSONListWritesWhatMarshalIndentWrites: a document streamed through jsonList, its list element by
// element and its other fields at the end, is byte for byte json.MarshalIndent of the whole object.
func TestJSONListWritesWhatMarshalIndentWrites(t *testing.T) {
	type elem struct {
		Node string   `json:"node"`
		Tags []string `json:"tags,omitempty"`
	}
	type rest struct {
		ID      string `json:"id"`
		Batches []int  `json:"batches"`
	}
	for _, elems := range [][]elem{nil, {{Node: "n1"}}, {{Node: "n1", Tags: []string{"a", "b"}}, {Node: "n2"}, {Node: `"q"`}}} {
		var got bytes.Buffer
		l := jsonList{w: &got, field: "nodes"}
		for _, e := range elems {
			if err := l.add(e); err != nil {
				t.Fatal(err)
			}
		}
		r := rest{ID: "gc-1", Batches: []int{1, 2}}
		if err := l.close(r); err != nil {
			t.Fatal(err)
		}
		whole := struct {
			Nodes []elem `json:"nodes"`
			rest
		}{Nodes: append([]elem{}, elems...), rest: r}
		want, err := json.MarshalIndent(whole, "", jsonIndent)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, '\n')
		if !bytes.Equal(got.Bytes(), want) {
			t.Errorf("%d elements: jsonList wrote\n%s\nMarshalIndent writes\n%s", len(elems), got.Bytes(), want)
		}
	}
	var got bytes.Buffer
	l := jsonList{w: &got, field: "nodes"}
	if err := l.close(struct{}{}); err != nil || got.String() != "{\n  \"nodes\": []\n}\n" {
		t.Errorf("no other field: %q, %v", got.String(), err)
	}
	if err := (&jsonList{w: &got, field: "nodes"}).close([]int{1}); err == nil {
		t.Error("a rest that is no object was taken")
	}
}
