package events

import (
	"encoding/json"
	"fmt"
)

// VerbPodApply is the command imagefleet.cmd.<node>.podapply, served by the node's pod index: it decides
// what each pod of a PodApplyRequest is (added or updated, its UID, pod or mirror pod), stores the pod
// events, and answers a PodApplyReply. `imagefleet pods apply` and `pods delete` use it.
const VerbPodApply = "podapply"

// Pod apply operations.
const (
	PodApply  = "apply"  // added when the index has no such pod, updated otherwise
	PodDelete = "delete" // deleted: the indexed pod
)

// PodApplyRequest is the body of imagefleet.cmd.<node>.podapply.
type PodApplyRequest struct {
	// Op is PodApply or PodDelete.
	Op string `json:"op"`
	// Pods are core/v1 Pods as JSON, applied in order. A pod without a namespace is in "default". A pod
	// without a UID is matched with the indexed pod of its namespace and name (a mirror pod manifest with
	// the indexed mirror pod, any other with the indexed pod); a new pod without a UID gets a random one.
	Pods []json.RawMessage `json:"pods"`
	// ByName: delete the indexed pod of each pod's namespace and name, or when there is none, the indexed
	// mirror pod of that name (the pods carry only their name and namespace).
	ByName bool `json:"byName,omitempty"`
	// Wait: answer once the index has applied the events (its state and queries show them), not only once
	// they are stored.
	Wait bool `json:"wait,omitempty"`
}

// Validate checks the request's shape (the pods themselves are checked by the index).
func (r PodApplyRequest) Validate() error {
	switch r.Op {
	case PodApply, PodDelete:
	default:
		return fmt.Errorf("%w: pod apply op %q: want %q or %q", ErrMalformed, r.Op, PodApply, PodDelete)
	}
	if r.ByName && r.Op != PodDelete {
		return fmt.Errorf("%w: byName is for %q only", ErrMalformed, PodDelete)
	}
	if len(r.Pods) == 0 {
		return fmt.Errorf("%w: no pods", ErrMalformed)
	}
	return nil
}

// PodApplyResult is what the index did with one pod (`pods apply -o json` prints an array of these).
type PodApplyResult struct {
	// Action is ActionAdded, ActionUpdated or ActionDeleted: the pod event stored.
	Action    string `json:"action"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// Mirror: the pod is a mirror pod.
	Mirror bool `json:"mirror,omitempty"`
}

// PodApplyReply answers a PodApplyRequest.
type PodApplyReply struct {
	Results []PodApplyResult `json:"results"`
	// Seq is the stream sequence (in IMAGEFLEET_EVENTS) of the last pod event stored.
	Seq uint64 `json:"seq"`
	// AppliedSeq is the index's applied sequence when it answered: at least Seq when the request asked to
	// wait.
	AppliedSeq uint64 `json:"appliedSeq"`
}
