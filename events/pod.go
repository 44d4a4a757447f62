package events

import (
	"encoding/json"
	"fmt"
)

// Entities and actions of the pod index.
//
// Pod events (imagefleet.evt.<node>.pod.added|updated|deleted) are the pod index's input. Unlike every other
// event they are not an Event envelope: the body is a Kubernetes core/v1 Pod as JSON and the envelope
// travels in CloudEvents binary-mode headers (ce-type imagefleet.pod.<action>.v1, ce-id = Nats-Msg-Id,
// ce-source, ce-time). The action is the subject's last token; a ce-type, when present, must agree with it.
//
// Secret and configmap registration events (imagefleet.evt.<node>.secret.registered ...) are ordinary Event
// envelopes whose data is a RefChange.
const (
	EntityPod       = "pod"
	EntitySecret    = "secret"
	EntityConfigMap = "configmap"

	ActionAdded   = "added"
	ActionUpdated = "updated"
	ActionDeleted = "deleted"

	ActionRegistered   = "registered"   // an object's reference count went 0 -> 1
	ActionUnregistered = "unregistered" // an object's reference count went 1 -> 0
)

// UpsertAction is the action of a pod event that upserts a pod: updated when the index holds the pod (its
// UID) as far as the publisher knows, added when it does not. Every publisher derives it here: the pod index's
// apply (from the index itself), its static pod source (from the index's listing at its start and what it
// published since) and the pod sources (from what they published). Applying an event does not look at it:
// added and updated are one upsert, and what changes is decided by what the index holds. The action is for
// the event's other readers (the puller pulls the images of an added pod) and the applied-events counter.
func UpsertAction(held bool) string {
	if held {
		return ActionUpdated
	}
	return ActionAdded
}

// Annotations the kubelet's pod manager reads (k8s.io/kubernetes/pkg/kubelet/types): pod sources set
// them on the pods of their events, the pod index reads them (static and mirror pods).
const (
	ConfigSourceAnnotationKey    = "kubernetes.io/config.source"
	ConfigMirrorAnnotationKey    = "kubernetes.io/config.mirror" // v1.MirrorPodAnnotationKey
	ConfigHashAnnotationKey      = "kubernetes.io/config.hash"
	ConfigFirstSeenAnnotationKey = "kubernetes.io/config.seen"

	// ApiserverSource is the config source of pods from the API server; any other source makes a static pod.
	ApiserverSource = "api"
	// FileSource is the config source of static pods read from the manifest directory.
	FileSource = "file"
)

// PodEventSubjects is the subject filter of every pod event of node: imagefleet.evt.<node>.pod.*.
func PodEventSubjects(node string) string {
	return Prefix + ".evt." + NodeToken(node) + "." + EntityPod + ".*"
}

// Reference kinds, as Kubernetes kinds.
const (
	KindSecret    = "Secret"
	KindConfigMap = "ConfigMap"
)

// Ref is one registered object with its reference count: the number of registered pods naming it
// (imagefleet refs -o json prints an array of these).
type Ref struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Count     int    `json:"count"`
}

// RefChange is the data of secret.registered, secret.unregistered, configmap.registered and
// configmap.unregistered: the object whose count went 0 -> 1 or 1 -> 0, and the pod whose registration or
// unregistration caused it.
type RefChange struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Count     int    `json:"count"`
	PodUID    string `json:"podUID"`
	PodName   string `json:"podName"`
	// StreamSeq is the sequence of the pod event (in IMAGEFLEET_EVENTS) that caused the change.
	StreamSeq uint64 `json:"streamSeq"`
}

// PodsQuery is the body of imagefleet.qry.<node>.pods. At most one selector is set: UID (a mirror pod's UID
// is translated to its static pod, as the kubelet's TranslatePodUID), Namespace+Name, or Orphaned; none
// lists every pod.
type PodsQuery struct {
	UID       string `json:"uid,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	// Orphaned lists the orphaned mirror pods only (mirror pods with no static pod of the same full name).
	Orphaned bool `json:"orphaned,omitempty"`
	// Source keeps, in a listing, only the pods whose kubernetes.io/config.source annotation is Source
	// ("file": the static pods of the manifest directory).
	Source string `json:"source,omitempty"`
	// A listing is one sequence: the pods, then the mirror pods, each sorted by namespace, name and UID.
	// After (a PodsReply.Next) starts it after that entry; Limit caps the entries of the reply (0: no cap).
	// A reply also stops before MaxPodsPageBytes of pod JSON, so it always fits a NATS message:
	// PodsReply.Truncated then says more follow. A page starts after the last entry of the one before, so
	// pods added or deleted between pages shift nothing: each pod there all along is listed once.
	After string `json:"after,omitempty"`
	Limit int    `json:"limit,omitempty"`
}

// MaxPodsPageBytes is the pod JSON one PodsReply carries at most (a single pod over it is sent alone): half
// of NATS's default max_payload, leaving room for the rest of the reply.
const MaxPodsPageBytes = 512 << 10

// Validate checks the query.
func (q PodsQuery) Validate() error {
	n := 0
	if q.UID != "" {
		n++
	}
	if q.Namespace != "" || q.Name != "" {
		if q.Namespace == "" || q.Name == "" {
			return fmt.Errorf("a pod is selected by namespace and name together")
		}
		n++
	}
	if q.Orphaned {
		n++
	}
	if n > 1 {
		return fmt.Errorf("select pods by uid, by namespace and name, or orphaned, not several")
	}
	if q.Limit < 0 {
		return fmt.Errorf("limit %d must not be negative", q.Limit)
	}
	if (q.UID != "" || q.Name != "") && (q.Source != "" || q.After != "") {
		return fmt.Errorf("source and after apply to a listing, not to a selected pod")
	}
	if q.Orphaned && q.Source != "" {
		return fmt.Errorf("source applies to a listing of every pod, not to the orphaned mirror pods")
	}
	return nil
}

// PodsReply answers imagefleet.qry.<node>.pods. Pods and MirrorPods are core/v1 Pods as JSON, sorted by
// namespace, name and UID.
type PodsReply struct {
	Node string `json:"node"`
	// Pods are the non-mirror pods selected (static pods included).
	Pods []json.RawMessage `json:"pods"`
	// MirrorPods are the mirror pods selected: for a single pod, its mirror; for a listing, every one.
	MirrorPods []json.RawMessage `json:"mirrorPods"`
	// OrphanedMirrorPods are the full names (name_namespace) of mirror pods without a static pod.
	OrphanedMirrorPods []string `json:"orphanedMirrorPods"`
	// StaleMirrorPods are the UIDs of the mirror pods selected (for a listing: of the whole listing) that have
	// a static pod of their name but are not its mirror (the kubelet's IsMirrorPodOf is false: their
	// config.mirror is not the static pod's config.hash, as after the manifest changed; the kubelet deletes
	// and recreates such a mirror pod).
	StaleMirrorPods []string `json:"staleMirrorPods,omitempty"`
	// MirrorToPod maps each mirror pod UID to its static pod UID (the kubelet's GetUIDTranslations).
	MirrorToPod map[string]string `json:"mirrorToPod"`
	// PodToMirror maps each static pod UID to its mirror pod UID, "" when it has none.
	PodToMirror map[string]string `json:"podToMirror"`
	// Total is the number of non-mirror pods in the index. Truncated says the listing goes on past this
	// reply (Limit or MaxPodsPageBytes cut it): ask again with After = Next (an opaque token).
	Total     int    `json:"total"`
	Truncated bool   `json:"truncated,omitempty"`
	Next      string `json:"next,omitempty"`
	// AppliedSeq is the stream sequence of the last pod event the index applied.
	AppliedSeq uint64 `json:"appliedSeq"`
	// Gaps counts the times since the index started that the events stream had dropped events it had yet to
	// read (some may have been pod events): a pod source seeing it grow reconciles with the index.
	Gaps uint64 `json:"gaps,omitempty"`
}

// RefsReply answers imagefleet.qry.<node>.refs: every registered secret and configmap, sorted by kind,
// namespace and name.
type RefsReply struct {
	Node       string `json:"node"`
	Refs       []Ref  `json:"refs"`
	AppliedSeq uint64 `json:"appliedSeq"`
}
