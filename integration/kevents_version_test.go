package integration_test

import (
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestKubeEventsBridgeReadsBothVersions: during a rolling upgrade one agent writes v1 events and another v2
// (the envelope in CloudEvents extension attributes); the bridge posts both to a real kube-apiserver alike:
// reason, message, type and the involved object (a pod's container, the Node) come from the v2 headers.
func TestKubeEventsBridgeReadsBothVersions(t *testing.T) {
	ctx := t.Context()
	const ns = "kev2"
	_, admin, nodeClient, pod := keCluster(t, ns, v1.PodSpec{NodeName: keNode, Containers: []v1.Container{{Name: "app", Image: "lab/app:1"}}})
	srv, bV1 := bustest.Start(t)
	bV2 := bustest.Connect(t, srv)
	if err := bV2.SetEventVersion(events.V2); err != nil {
		t.Fatal(err)
	}
	podRef := &events.ObjectRef{Kind: "Pod", Namespace: ns, Name: pod.Name, UID: string(pod.UID), FieldPath: "spec.containers{app}"}
	mk := func(entity, action, severity, reason, msg string, obj *events.ObjectRef) events.Event {
		ev, err := events.New(keNode, entity, action, nil)
		if err != nil {
			t.Fatal(err)
		}
		return ev.WithKube(severity, reason, msg, obj)
	}
	pulling := mk(events.EntityPull, events.ActionPulling, events.Normal, "Pulling", `Pulling image "lab/app:1"`, podRef)
	failed := mk(events.EntityPull, events.ActionFailed, events.Warning, "Failed", `Failed to pull image "lab/app:1": not found`, podRef)
	disk := mk(events.EntityNode, events.ActionWarning, events.Warning, "FreeDiskSpaceFailed", "Insufficient free disk space on the node's image filesystem", &events.ObjectRef{Kind: "Node", Name: keNode})
	if err := bV1.Publish(ctx, pulling); err != nil {
		t.Fatal(err)
	}
	for _, ev := range []events.Event{failed, disk} {
		if err := bV2.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}

	const durable = "kube-events-node-1"
	stop := keBridge(t, bV1, nodeClient, durable)
	keDrained(t, bV1, durable, 60*time.Second)
	stop()
	podEvs, nodeEvs := keEvents(t, admin, ns), keEvents(t, admin, metav1.NamespaceDefault)
	t.Logf("pod events:\n  %s\nnode events:\n  %s", strings.Join(keSummary(podEvs), "\n  "), strings.Join(keSummary(nodeEvs), "\n  "))
	got := map[string]v1.Event{}
	for _, e := range podEvs {
		got[e.Reason] = e
	}
	for _, e := range nodeEvs {
		got[e.Reason] = e
	}
	for _, w := range []struct {
		ev            events.Event
		kind, version string
	}{{pulling, "Pod", events.V1}, {failed, "Pod", events.V2}, {disk, "Node", events.V2}} {
		e, ok := got[w.ev.Reason]
		if !ok {
			t.Errorf("no Event %s posted (published as %s)", w.ev.Reason, w.version)
			continue
		}
		o := e.InvolvedObject
		if o.Kind != w.kind || e.Type != w.ev.Severity || e.Message != w.ev.Message || e.Count != 1 || e.Source.Host != keNode {
			t.Errorf("Event %s: %+v %s %q x%d, want on a %s, %s %q once", w.ev.Reason, o, e.Type, e.Message, e.Count, w.kind, w.ev.Severity, w.ev.Message)
		}
		if w.kind == "Pod" && (o.Namespace != ns || o.Name != pod.Name || o.UID != pod.UID || o.FieldPath != "spec.containers{app}") {
			t.Errorf("Event %s on %+v, want the pod's container app", w.ev.Reason, o)
		}
		if w.kind == "Node" && o.Name != keNode {
			t.Errorf("Event %s on %+v, want node %s", w.ev.Reason, o, keNode)
		}
	}
	if len(podEvs) != 2 || len(nodeEvs) != 1 {
		t.Errorf("%d pod and %d node Events, want 2 and 1", len(podEvs), len(nodeEvs))
	}
}
