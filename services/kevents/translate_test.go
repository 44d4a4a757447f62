package kevents

import (
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
)

func pullEvent(id, reason, sev, msg string, obj *events.ObjectRef) events.Event {
	return events.Event{Type: events.TypeName(events.EntityPull, events.ActionFailed), ID: id, Node: "node-1",
		Time: time.Date(2026, 11, 23, 21, 0, 0, 0, time.UTC), Reason: reason, Severity: sev, Message: msg, Object: obj}
}

func TestKubeRef(t *testing.T) {
	pod := &events.ObjectRef{Kind: "Pod", Namespace: "ns", Name: "web", UID: "uid-1", FieldPath: "spec.initContainers{init}"}
	cases := []struct {
		name string
		ev   events.Event
		want *v1.ObjectReference
		why  string
	}{
		{"node warning is about the kubelet's nodeRef",
			pullEvent("1", "FreeDiskSpaceFailed", events.Warning, "m", &events.ObjectRef{Kind: "Node", Name: "node-1"}),
			&v1.ObjectReference{Kind: "Node", Name: "node-1", UID: "node-1"}, ""},
		{"pull event is about the container",
			pullEvent("2", "Pulling", events.Normal, "m", pod),
			&v1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: "ns", Name: "web", UID: "uid-1", FieldPath: "spec.initContainers{init}"}, ""},
		{"pre-pull without a pod is logged only", pullEvent("3", "Pulled", events.Normal, "m", nil), nil, whyNoObject},
		{"registration events have no severity", pullEvent("4", "Registered", "", "m", pod), nil, whyNotKube},
		{"no reason", pullEvent("5", "", events.Normal, "m", pod), nil, whyNotKube},
		{"odd severity", pullEvent("6", "Pulled", "Error", "m", pod), nil, whyUnknownType},
		{"pod without namespace", pullEvent("7", "Pulled", events.Normal, "m", &events.ObjectRef{Kind: "Pod", Name: "web"}), nil, whyObjectName},
		{"node without name", pullEvent("8", "ImageGCFailed", events.Warning, "m", &events.ObjectRef{Kind: "Node"}), nil, whyObjectName},
		{"other kind", pullEvent("9", "X", events.Normal, "m", &events.ObjectRef{Kind: "ConfigMap", Name: "c", Namespace: "n"}), nil, whyObjectKind},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, why := kubeRef(c.ev)
			if why != c.why {
				t.Fatalf("why %q, want %q", why, c.why)
			}
			if (got == nil) != (c.want == nil) || got != nil && *got != *c.want {
				t.Fatalf("ref %+v, want %+v", got, c.want)
			}
		})
	}
}

func TestMakeEvent(t *testing.T) {
	pod := &events.ObjectRef{Kind: "Pod", Namespace: "ns", Name: "web", UID: "uid-1", FieldPath: "spec.containers{app}"}
	ev := pullEvent("abc", "Failed", events.Warning, `Failed to pull image "r.example/app:1": rpc error: code = Unknown desc = failed to resolve: https://bob:hunter2@r.example/v2/: 401 Unauthorized`, pod)
	ref, _ := kubeRef(ev)
	e := makeEvent(ev, ref, "imagefleet", "node-1")
	again := makeEvent(ev, ref, "imagefleet", "node-1")
	if e.Name != again.Name || !strings.HasPrefix(e.Name, "web.") || len(e.Name) != len("web.")+16 {
		t.Fatalf("names %q and %q: want the same web.<16 hex> for the same event", e.Name, again.Name)
	}
	other := ev
	other.ID = "abd"
	if makeEvent(other, ref, "imagefleet", "node-1").Name == e.Name {
		t.Fatalf("two events share the name %q", e.Name)
	}
	if e.Namespace != "ns" || e.Type != v1.EventTypeWarning || e.Reason != "Failed" || e.Count != 1 ||
		!e.FirstTimestamp.Time.Equal(ev.Time) || !e.LastTimestamp.Time.Equal(ev.Time) ||
		e.Source != (v1.EventSource{Component: "imagefleet", Host: "node-1"}) || e.ReportingController != "imagefleet" || e.ReportingInstance != "node-1" {
		t.Fatalf("event %+v", e)
	}
	if strings.Contains(e.Message, "hunter2") || !strings.Contains(e.Message, "https://REDACTED@r.example/v2/: 401 Unauthorized") {
		t.Fatalf("message %q: the password must be gone, the rest kept", e.Message)
	}
	node := pullEvent("n1", "ImageGCFailed", events.Warning, "m", &events.ObjectRef{Kind: "Node", Name: "node-1"})
	nref, _ := kubeRef(node)
	if ne := makeEvent(node, nref, "kubelet", "node-1"); ne.Namespace != "default" || ne.InvolvedObject.Namespace != "" {
		t.Fatalf("node event in namespace %q, object namespace %q: want default and none", ne.Namespace, ne.InvolvedObject.Namespace)
	}
	long := &events.ObjectRef{Kind: "Pod", Namespace: "ns", Name: strings.Repeat("a", 253)}
	lref, _ := kubeRef(pullEvent("l", "Pulled", events.Normal, "m", long))
	if n := makeEvent(ev, lref, "imagefleet", "node-1").Name; len(n) > 253 {
		t.Fatalf("name of %d characters", len(n))
	}
}

func TestPostable(t *testing.T) {
	for subj, want := range map[string]bool{
		events.EventSubject("node.a", events.EntityPull, events.ActionFailed):   true,
		events.EventSubject("node-1", events.EntityNode, events.ActionWarning):  true,
		events.EventSubject("node-1", events.EntityImage, events.ActionRemoved): true,
		events.EventSubject("node-1", "pod", "added"):                           false,
		events.EventSubject("node-1", "secret", "registered"):                   false,
		"imagefleet.cmd.node-1.pull":                                            false,
		"imagefleet.evt":                                                        false,
	} {
		if got := postable(subj); got != want {
			t.Errorf("postable(%q) = %v, want %v", subj, got, want)
		}
	}
}

func TestDedupKey(t *testing.T) {
	ev := pullEvent("0123abcd", "Pulled", events.Normal, "m", nil)
	ev.Node = "node.a"
	if k := dedupKey(ev); k != "node_a.0123abcd" {
		t.Fatalf("key %q", k)
	}
	ev.ID = "odd id/with*chars"
	if k := dedupKey(ev); !strings.HasPrefix(k, "node_a.h") || strings.ContainsAny(k[len("node_a."):], " /*.") {
		t.Fatalf("key %q is not a valid key of the node", k)
	}
}

func TestConfig(t *testing.T) {
	c := Config{Node: "node-1"}
	if err := c.setDefaults(); err != nil || c.Durable != "kube-events-node-1" || c.Component != "imagefleet" || !*c.VerifyPods {
		t.Fatalf("defaults %+v, %v", c, err)
	}
	for _, bad := range []Config{{}, {Node: "Node_1"}, {Node: "n", DedupTTL: -1}, {Node: "n", RetryMax: time.Minute}} {
		if err := bad.setDefaults(); err == nil {
			t.Errorf("config %+v accepted", bad)
		}
	}
}

// The names a node identity's NATS permissions allow (deploy/natsconf) are the bridge's.
func TestNamesMatchPermissions(t *testing.T) {
	if got, want := Durable("node.a"), "kube-events-node_a"; got != want {
		t.Fatalf("durable %q, permissions allow %q", got, want)
	}
	if !slices.Contains(natsconf.NodeBuckets, DedupBucket) {
		t.Fatalf("bucket %s is not among the node buckets %q", DedupBucket, natsconf.NodeBuckets)
	}
}
