package kevents

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"regexp"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record/util"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/redact"
)

// Why an event is not posted (the label of imagefleet_kube_events_total{result="ignored"}'s log line).
const (
	whyNotKube     = "no Kubernetes reason and type"   // an event the kubelet has no Event for
	whyNoObject    = "no involved object"              // e.g. a pre-pull with no pod: the kubelet logs those
	whyObjectKind  = "involved object kind not posted" // only Node and Pod
	whyObjectName  = "involved object without a name or namespace"
	whyUnknownType = "severity neither Normal nor Warning"
)

// kubeRef returns the involved object of ev as the kubelet builds it, or why ev is not posted.
//
//   - Node (FreeDiskSpaceFailed, ImageGCFailed, InvalidDiskCapacity): the kubelet's nodeRef, Kind Node, name
//     and UID the node name, no namespace (its Events live in "default").
//   - Pod (Pulling, Pulled, Failed, BackOff, ErrImageNeverPull, InspectFailed): the container reference,
//     apiVersion v1, the pod's namespace, name and UID, and the container's fieldPath
//     (spec.containers{name}, spec.initContainers{name}).
func kubeRef(ev events.Event) (*v1.ObjectReference, string) {
	if ev.Reason == "" || ev.Severity == "" {
		return nil, whyNotKube
	}
	if ev.Severity != v1.EventTypeNormal && ev.Severity != v1.EventTypeWarning {
		return nil, whyUnknownType
	}
	o := ev.Object
	if o == nil {
		return nil, whyNoObject
	}
	switch o.Kind {
	case "Node":
		if o.Name == "" {
			return nil, whyObjectName
		}
		return &v1.ObjectReference{Kind: "Node", Name: o.Name, UID: types.UID(o.Name)}, ""
	case "Pod":
		if o.Name == "" || o.Namespace == "" {
			return nil, whyObjectName
		}
		return &v1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: o.Namespace, Name: o.Name,
			UID: types.UID(o.UID), FieldPath: o.FieldPath}, ""
	default:
		return nil, whyObjectKind
	}
}

// makeEvent is client-go's recorder makeEvent for ev, with two differences: the time is the happening's
// (ev.Time, so Events posted after an outage tell when it happened), and the name's suffix derives from the
// imagefleet event id instead of the clock, in the recorder's format (<object>.<16 hex digits>), so the
// same happening always makes the same Event name.
func makeEvent(ev events.Event, ref *v1.ObjectReference, component, host string) *v1.Event {
	t := metav1.Time{Time: ev.Time}
	ns := ref.Namespace
	if ns == "" {
		ns = metav1.NamespaceDefault
	}
	sum := sha256.Sum256([]byte(ev.Node + "\x00" + ev.ID))
	suffix := int64(binary.BigEndian.Uint64(sum[:8]) >> 1)
	return &v1.Event{
		ObjectMeta:          metav1.ObjectMeta{Name: util.GenerateEventName(ref.Name, suffix), Namespace: ns},
		InvolvedObject:      *ref,
		Reason:              ev.Reason,
		Message:             redact.Secrets(ev.Message),
		FirstTimestamp:      t,
		LastTimestamp:       t,
		Count:               1,
		Type:                ev.Severity,
		Source:              v1.EventSource{Component: component, Host: host},
		ReportingController: component,
		ReportingInstance:   host,
	}
}

// dedupKey is the bucket key of ev: <node token>.<id>, the id hashed when it has characters a key may not.
func dedupKey(ev events.Event) string {
	id := ev.ID
	if !keyRE.MatchString(id) {
		sum := sha256.Sum256([]byte(id))
		id = fmt.Sprintf("h%x", sum[:16])
	}
	return events.NodeToken(ev.Node) + "." + id
}

var keyRE = regexp.MustCompile(`^[-_=a-zA-Z0-9]{1,200}$`)
