package events

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"time"
)

// Pull requests, cancellations and results.
//
// A pull request is a command stored in the node's partition of the work queue, PullStreamOf(node), on
// PullSubject(node) = imagefleet.cmd.<node>.pull.<pp> (in the single queue of the older layout: PullStream on
// imagefleet.cmd.<node>.pull, compat_single_queue.go), with Nats-Msg-Id = its ID, so a retried publish is
// stored once. What happens to it is told by events on imagefleet.evt.<node>.pull.<action>: at most one
// pull.pulling (the kubelet's Normal Pulling event) and then exactly one terminal event, pull.pulled or
// pull.failed, whose id is PullResultEventID(request ID): a duplicate result (a request redelivered after a
// puller died between publishing and acking) is dropped by the events stream's de-duplication.
const (
	EntityPull = "pull"

	ActionPulling = "pulling" // progress: the runtime pull starts (reason Pulling)
	ActionPulled  = "pulled"  // terminal success (reason Pulled)
	ActionFailed  = "failed"  // terminal failure (reason Failed, BackOff, InspectFailed or ErrImageNeverPull)

	// VerbPullCancel is the core NATS subject token of pull cancellations: imagefleet.cmd.<node>.pullcancel.
	// It is in no pull stream (they take only ...pull and ...pull.<pp>) and every puller replica of the node
	// hears it.
	VerbPullCancel = "pullcancel"

	// MaxPullRequestsPerNode is the most pull requests of one node the work queue holds at once, in flight
	// or waiting: the kubelet's serial puller (one pull plus maxImagePullRequests = 10 queued). The stream
	// enforces it per subject and answers the 12th publish with an error at once (see puller.ErrPullQueueFull).
	MaxPullRequestsPerNode = 1 + 10
)

// Pull policies, as Kubernetes spells them.
const (
	PullAlways       = "Always"
	PullIfNotPresent = "IfNotPresent"
	PullNever        = "Never"
)

// Error kinds of a failed pull: the kubelet's container waiting reasons (pkg/kubelet/images/types.go and
// k8s.io/cri-api/pkg/errors).
const (
	ErrKindImagePullBackOff          = "ImagePullBackOff"
	ErrKindImageInspect              = "ImageInspectError"
	ErrKindImagePull                 = "ErrImagePull"
	ErrKindImageNeverPull            = "ErrImageNeverPull"
	ErrKindInvalidImageName          = "InvalidImageName"
	ErrKindRegistryUnavailable       = "RegistryUnavailable"
	ErrKindSignatureValidationFailed = "SignatureValidationFailed"
)

// PodRef names the pod a pull is for. The kubelet keys its pull backoff by the pod UID.
type PodRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// FieldPath names the container the pull is for, as the kubelet's container reference does
	// (spec.containers{name}, spec.initContainers{name}, spec.ephemeralContainers{name}); the pull's
	// Kubernetes Events are about it. Optional (additive): a pull without it is about the pod.
	FieldPath string `json:"fieldPath,omitempty"`
}

// String is namespace/name/uid.
func (p PodRef) String() string { return p.Namespace + "/" + p.Name + "/" + p.UID }

// PullRequest is the body of imagefleet.cmd.<node>.pull.<pp> (PullSubject) and of the legacy
// imagefleet.cmd.<node>.pull.
type PullRequest struct {
	// ID identifies the request: it is the Nats-Msg-Id of the command and the key of its result event.
	ID string `json:"id"`
	// Image is the image as the pod spec writes it (the kubelet's requestedImage); an invalid reference is
	// not malformed: it is answered with InvalidImageName, as the kubelet does.
	Image string `json:"image"`
	// Policy is Always, IfNotPresent or Never; empty applies Kubernetes' defaulting (Always for a :latest or
	// untagged, undigested image, else IfNotPresent).
	Policy string `json:"policy,omitempty"`
	// Pod is the pod the pull is for (optional: a pre-pull has none; its backoff key is then "_<image>").
	Pod *PodRef `json:"pod,omitempty"`
	// Secrets are the names of the pod's image pull secrets (in the pod's namespace).
	Secrets []string `json:"secrets,omitempty"`
	// Annotations are the pod's annotations, sent to the runtime with the pull as the kubelet does.
	Annotations map[string]string `json:"annotations,omitempty"`
	// RuntimeHandler is the pod's runtime handler (RuntimeClassInImageCriAPI), usually empty.
	RuntimeHandler string `json:"runtimeHandler,omitempty"`
	// AllowPrivate lets a pull without a pod (a pre-pull) use the node's registry credentials (the node
	// keyring). Without it such a pull is refused: an image pulled through CRI has no kubelet pull record, so
	// under the kubelet's default imagePullCredentialsVerificationPolicy NeverVerifyPreloadedImages every pod
	// on the node could use the private image without credentials (KEP-2535; docs/kubernetes.md).
	AllowPrivate bool `json:"allowPrivate,omitempty"`
	// Enqueued is when the publisher queued the request (optional; gives the result's queueWait).
	Enqueued time.Time `json:"enqueued,omitempty"`
}

var requestIDRE = regexp.MustCompile(`^[A-Za-z0-9][-_.A-Za-z0-9]{0,127}$`)

// Validate checks the request. Everything it rejects can never be processed (dead letter); an image the
// reference grammar rejects is a valid request with an InvalidImageName result.
func (r PullRequest) Validate() error {
	if !requestIDRE.MatchString(r.ID) {
		return fmt.Errorf("request id %q must be 1-128 characters of letters, digits, '-', '_' and '.'", r.ID)
	}
	if r.Image == "" {
		return fmt.Errorf("image is empty")
	}
	if len(r.Image) > 4096 {
		return fmt.Errorf("image of %d bytes is longer than 4096", len(r.Image))
	}
	switch r.Policy {
	case "", PullAlways, PullIfNotPresent, PullNever:
	default:
		return fmt.Errorf("pull policy %q is not one of Always, IfNotPresent, Never", r.Policy)
	}
	if r.Pod != nil {
		if r.Pod.UID == "" {
			return fmt.Errorf("pod %s/%s has no uid", r.Pod.Namespace, r.Pod.Name)
		}
		if r.Pod.Name == "" {
			return fmt.Errorf("pod %s has no name", r.Pod.UID)
		}
	}
	for _, s := range r.Secrets {
		if s == "" {
			return fmt.Errorf("pull secret name is empty")
		}
	}
	if len(r.Secrets) > 0 && (r.Pod == nil || r.Pod.Namespace == "") {
		return fmt.Errorf("pull secrets need the pod's namespace")
	}
	return nil
}

// PullCancel is the body of imagefleet.cmd.<node>.pullcancel: cancel the pulls of a pod (every request of
// PodUID) or one request (RequestID). A pod.deleted event cancels the pod's pulls the same way
// (kubernetes/kubernetes#88662).
type PullCancel struct {
	PodUID    string `json:"podUID,omitempty"`
	RequestID string `json:"requestID,omitempty"`
}

// Validate checks the cancellation.
func (c PullCancel) Validate() error {
	if c.PodUID == "" && c.RequestID == "" {
		return fmt.Errorf("a pull cancellation names a pod uid or a request id")
	}
	return nil
}

// PullResult is the data of pull.pulled and pull.failed (and, with Error empty, of pull.pulling).
type PullResult struct {
	RequestID string  `json:"requestID"`
	Image     string  `json:"image"`
	Policy    string  `json:"policy"`
	Pod       *PodRef `json:"pod,omitempty"`
	// ImageRef is the image ID the runtime reports (empty on failure).
	ImageRef string `json:"imageRef,omitempty"`
	// ImageSize is the size the runtime reports after a pull (0 when the image was already present).
	ImageSize uint64 `json:"imageSize,omitempty"`
	// Pulled says a runtime pull happened for this request (false: already present, or it failed first).
	Pulled bool `json:"pulled"`
	// Shared says the request joined a pull of the same image another request had started (single-flight).
	Shared bool `json:"shared,omitempty"`
	// Error is one of the ErrKind values on failure; Message is the kubelet's message for it.
	Error   string `json:"error,omitempty"`
	Message string `json:"message,omitempty"`
	// Cancelled says the pull was cancelled (pod deleted or explicit cancellation).
	Cancelled bool `json:"cancelled,omitempty"`
	// PullDuration is the runtime pull; Duration the whole request in the puller; QueueWait the time the
	// request waited in the work queue.
	PullDuration Duration `json:"pullDuration"`
	Duration     Duration `json:"duration"`
	QueueWait    Duration `json:"queueWait"`
	// Deliveries is how many times the work queue delivered the request (more than 1 after a puller died).
	Deliveries uint64    `json:"deliveries,omitempty"`
	Finished   time.Time `json:"finished"`
}

// PullResultEventID is the event id of the terminal result of request id: derived, so a duplicate result is
// stored once.
func PullResultEventID(requestID string) string { return derivedID("pull-result", requestID) }

// PullingEventID is the event id of the pull.pulling event of request id.
func PullingEventID(requestID string) string { return derivedID("pull-pulling", requestID) }

func derivedID(kind, requestID string) string {
	sum := sha256.Sum256([]byte(kind + "\x00" + requestID))
	return hex.EncodeToString(sum[:16])
}
