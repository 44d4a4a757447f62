package events

import (
	"errors"
	"strings"
	"testing"
)

func TestDecodePodEvent(t *testing.T) {
	subj := EventSubject("node-1", EntityPod, ActionAdded)
	okBody := `{"metadata":{"name":"a","namespace":"ns","uid":"u"}}`
	tests := []struct {
		name       string
		subject    string
		header     map[string][]string
		body       string
		wantReason string
	}{
		{"ok", subj, nil, okBody, ""},
		{"ok with ce-type", subj, map[string][]string{"ce-type": {"imagefleet.pod.added.v1"}}, okBody, ""},
		{"unknown fields are ignored", subj, nil, `{"metadata":{"name":"a","namespace":"ns","uid":"u"},"future":1}`, ""},
		{"ce-type disagrees", subj, map[string][]string{"ce-type": {"imagefleet.pod.deleted.v1"}}, okBody, PodRejectBadType},
		{"not a pod subject", "imagefleet.evt.n.image.added", nil, okBody, PodRejectBadSubject},
		{"unknown action", "imagefleet.evt.n.pod.exploded", nil, okBody, PodRejectBadType},
		{"empty body", subj, nil, ``, PodRejectBadPod},
		{"wrong type", subj, nil, `{"metadata":{"name":5}}`, PodRejectBadPod},
		{"no name", subj, nil, `{"metadata":{"namespace":"ns","uid":"u"}}`, PodRejectBadPod},
		{"no namespace", subj, nil, `{"metadata":{"name":"a","uid":"u"}}`, PodRejectBadPod},
		{"no uid", subj, nil, `{"metadata":{"name":"a","namespace":"ns"}}`, PodRejectNoUID},
		{"wrong apiVersion", subj, nil, `{"apiVersion":"v2","metadata":{"name":"a","namespace":"ns","uid":"u"}}`, PodRejectBadPod},
		{"structured mode (body)", subj, nil, `{"specversion":"1.0","type":"imagefleet.pod.added.v1","source":"x","id":"1","data":{"metadata":{"name":"a","namespace":"ns","uid":"u"}}}`, PodRejectBadPod},
		{"structured mode (content type)", subj, map[string][]string{"content-type": {"application/cloudevents+json"}}, okBody, PodRejectBadPod},
		{"too large", subj, nil, `{"x":"` + strings.Repeat("a", MaxMessageBytes) + `"}`, PodRejectTooLarge},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ev, err := DecodePodEvent(tc.subject, tc.header, []byte(tc.body))
			if tc.wantReason == "" {
				if err != nil || ev.Pod.UID != "u" || ev.Action != ActionAdded {
					t.Fatalf("decode = %+v, %v", ev, err)
				}
				return
			}
			if err == nil || PodRejectReason(err) != tc.wantReason || !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v (reason %q), want reason %q wrapping ErrMalformed", err, PodRejectReason(err), tc.wantReason)
			}
		})
	}
}

// TestDecodeErrorsNameTheField: a type error names the field by its path, a key with "/" or "~" in it (as
// label keys have) unescaped from the JSON pointer the decoder reports.
func TestDecodeErrorsNameTheField(t *testing.T) {
	subj := EventSubject("node-1", EntityPod, ActionAdded)
	for body, want := range map[string]string{
		`{"metadata":{"name":5}}`: `field "metadata.name" must be string, not number`,
		`{"metadata":{"name":"a","namespace":"ns","uid":"u","labels":{"app.kubernetes.io/na~me":1}}}`: `field "metadata.labels.app.kubernetes.io/na~me" must be string, not number`,
		`{"spec":{"containers":[{"name":"c"},{"name":true}]}}`:                                        `field "spec.containers.1.name" must be string, not bool`,
		`{"metadata":`: `invalid JSON at offset 12`,
	} {
		_, err := DecodePodEvent(subj, nil, []byte(body))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("decode %s: error %v, want it to say %s", body, err, want)
		}
	}
}

// TestStructuredModeRefusedWithTheTrueReason: a structured-mode CloudEvent (the event as the JSON body) is
// refused as such, not as "pod has no metadata.name".
func TestStructuredModeRefusedWithTheTrueReason(t *testing.T) {
	subj := EventSubject("node-1", EntityPod, ActionAdded)
	body := `{"specversion":"1.0","type":"imagefleet.pod.added.v1","source":"x","id":"1","data":{"metadata":{"name":"a","namespace":"ns","uid":"u"}}}`
	_, err := DecodePodEvent(subj, nil, []byte(body))
	if err == nil || !strings.Contains(err.Error(), "structured-mode CloudEvent") {
		t.Fatalf("error %v, want it to say the body is a structured-mode CloudEvent", err)
	}
}
