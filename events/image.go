package events

import (
	"fmt"
	"strings"
	"time"
)

// Entities and actions of image lifecycle events.
const (
	EntityImage = "image"
	EntityGC    = "gc"
	EntityNode  = "node"

	ActionDetected = "detected" // a new image record
	ActionRemoved  = "removed"  // an image removed by GC
	ActionVanished = "vanished" // a record dropped because the runtime no longer lists the image
	ActionWarning  = "warning"  // a Kubernetes Warning event on the node (InvalidDiskCapacity, FreeDiskSpaceFailed, ImageGCFailed)
	ActionFinished = "finished" // one GC pass finished (its result is the data)
)

// ImageRecord is the detector's record of one image on one node (the kubelet's imageRecord, plus identity).
type ImageRecord struct {
	ID            string    `json:"id"`
	RepoTags      []string  `json:"repoTags,omitempty"`
	RepoDigests   []string  `json:"repoDigests,omitempty"`
	Size          int64     `json:"size"`
	Pinned        bool      `json:"pinned"`
	InUse         bool      `json:"inUse"`
	FirstDetected time.Time `json:"firstDetected"`
	LastUsed      time.Time `json:"lastUsed"`
}

// Image is one entry of the cached image list (node status).
type Image struct {
	ID          string   `json:"id"`
	RepoTags    []string `json:"repoTags,omitempty"`
	RepoDigests []string `json:"repoDigests,omitempty"`
	Size        int64    `json:"size"`
	Pinned      bool     `json:"pinned,omitempty"`
}

// ImageRemoved is the data of image.removed.
type ImageRemoved struct {
	ID       string   `json:"id"`
	RepoTags []string `json:"repoTags,omitempty"`
	Size     int64    `json:"size"`
	Reason   string   `json:"reason"` // space | age | unused | named
}

// DetectRequest is the body of imagefleet.cmd.<node>.detect.
type DetectRequest struct {
	// Time is the detect time given to new records as firstDetected (default: now). The GC executor passes
	// its freeTime, as the kubelet's imagesInEvictionOrder does.
	Time *time.Time `json:"time,omitempty"`
	// WithRecords asks for the node's records in the reply (DetectReply.List), so the asker need not list the
	// records bucket (a KV listing is a JetStream consumer made and deleted: two API requests, the second
	// through the meta leader on a cluster, besides the records). The GC executor asks. A detector that does
	// not know the field refuses it as unknown (ErrMalformed): the asker then detects without it and lists
	// the bucket (docs/upgrading.md, "Compatibility paths").
	WithRecords bool `json:"withRecords,omitempty"`
}

// MaxDetectReplyListBytes bounds DetectReply.List's JSON: a node whose records take more is answered
// without them (Listed false) and the asker lists the bucket (NATS's default max payload is 1 MiB).
const MaxDetectReplyListBytes = 512 << 10

// DetectReply answers a detect command. The records themselves are in the records KV bucket (a node can
// have more records than fit in one message), and in List when the request asked WithRecords and they fit.
type DetectReply struct {
	Node     string    `json:"node"`
	Time     time.Time `json:"time"`
	Records  int       `json:"records"`
	InUse    int       `json:"inUse"`
	Added    int       `json:"added"`
	Removed  int       `json:"removed"`
	Duration Duration  `json:"duration"`
	// Unpublished counts the node's image events (this detection's and earlier ones') that NATS has not
	// taken yet: the records are written, and the detector publishes those events again on its own schedule.
	Unpublished int `json:"unpublished,omitempty"`
	// Listed says List holds every record of the node after this detection (what the bucket holds once
	// the detection's write is stored), sorted by ID; false: List is absent, read the bucket.
	Listed bool          `json:"listed,omitempty"`
	List   []ImageRecord `json:"list,omitempty"`
}

// QueryRequest is the body of the record and image queries.
type QueryRequest struct {
	// Limit caps the answer (0: no cap). The images query of node status uses 50 (nodeStatusMaxImages).
	Limit int `json:"limit,omitempty"`
}

// Validate checks the query.
func (q QueryRequest) Validate() error {
	if q.Limit < 0 {
		return fmt.Errorf("limit %d must not be negative", q.Limit)
	}
	return nil
}

// ImagesReply answers imagefleet.qry.<node>.images.
type ImagesReply struct {
	Node      string    `json:"node"`
	Refreshed time.Time `json:"refreshed"`
	Images    []Image   `json:"images"`
}

// RecordsReply answers imagefleet.qry.<node>.records.
type RecordsReply struct {
	Node    string        `json:"node"`
	Records []ImageRecord `json:"records"`
}

// GCRequest is the body of imagefleet.cmd.<node>.gc. Unset policy fields keep the agent's configuration.
type GCRequest struct {
	// ID, when set, names the request: the node's executor answers a repeat of an id it saw in the last 10
	// minutes with the first request's result, without a second pass. A sender whose reply was lost (a
	// server of the cluster went away) can so ask again safely; fleet GC sets it to <rollout id>.<node>.
	ID        string `json:"id,omitempty"`
	DryRun    bool   `json:"dryRun,omitempty"`
	AllUnused bool   `json:"allUnused,omitempty"` // DeleteUnusedImages: every eligible unused image
	// Policy overrides.
	HighThresholdPercent *int      `json:"highThresholdPercent,omitempty"`
	LowThresholdPercent  *int      `json:"lowThresholdPercent,omitempty"`
	MinAge               *Duration `json:"minAge,omitempty"`
	MaxAge               *Duration `json:"maxAge,omitempty"`
	// Trigger names why the pass is asked for (default manual; the puller sends pull when it makes room
	// before a pull). Added field.
	Trigger string `json:"trigger,omitempty"`
	// Images, when set, makes the pass remove every unused image named by one of these, whatever the usage
	// and the minimum age (Eraser's ImageList; an ImageGC's spec.images): a reference ("busybox:1.37",
	// normalized as --pinned-images are), an image ID or repo digest, or a glob ('*' any run of characters,
	// '/' included; '?' one). Pinned and in-use images are kept. At most MaxGCImages. Added field.
	Images []string `json:"images,omitempty"`
}

// MaxGCImages bounds GCRequest.Images.
const MaxGCImages = 64

// Validate checks the overrides with the kubelet's image GC policy messages.
func (r GCRequest) Validate() error {
	if r.ID != "" && !requestIDRE.MatchString(r.ID) {
		return fmt.Errorf("gc request id %q must be 1-128 characters of letters, digits, '-', '_' and '.'", r.ID)
	}
	if r.HighThresholdPercent != nil && (*r.HighThresholdPercent < 0 || *r.HighThresholdPercent > 100) {
		return fmt.Errorf("invalid HighThresholdPercent %d, must be in range [0-100]", *r.HighThresholdPercent)
	}
	if r.LowThresholdPercent != nil && (*r.LowThresholdPercent < 0 || *r.LowThresholdPercent > 100) {
		return fmt.Errorf("invalid LowThresholdPercent %d, must be in range [0-100]", *r.LowThresholdPercent)
	}
	if r.MinAge != nil && r.MinAge.Duration < 0 {
		return fmt.Errorf("imageMinimumGCAge %v must not be negative", r.MinAge.Duration)
	}
	if r.MaxAge != nil && r.MaxAge.Duration < 0 {
		return fmt.Errorf("imageMaximumGCAge %v must not be negative", r.MaxAge.Duration)
	}
	if len(r.Images) > MaxGCImages {
		return fmt.Errorf("gc request names %d images, more than %d", len(r.Images), MaxGCImages)
	}
	for _, im := range r.Images {
		if im == "" || len(im) > 512 || strings.ContainsAny(im, " \t\n") {
			return fmt.Errorf("gc request image %q must be 1-512 characters without spaces", im)
		}
	}
	if len(r.Images) > 0 && r.AllUnused {
		return fmt.Errorf("gc request: images and allUnused exclude each other")
	}
	switch r.Trigger {
	case "", GCTriggerManual, GCTriggerPull:
	default:
		return fmt.Errorf("gc request trigger %q must be %q or %q", r.Trigger, GCTriggerManual, GCTriggerPull)
	}
	return nil
}

// What starts a GC pass (GCResult.Trigger, the trigger label of kubelet_image_gc_attempts_total).
const (
	GCTriggerPeriodic = "periodic" // the ImageGCPeriod loop
	GCTriggerUsage    = "usage"    // the usage check saw the high threshold reached
	GCTriggerPull     = "pull"     // the puller making room before a pull
	GCTriggerManual   = "manual"   // a gc command
)

// GCRemoved is one image a GC pass removed (or, in a dry run, would remove).
type GCRemoved struct {
	ID       string   `json:"id"`
	RepoTags []string `json:"repoTags,omitempty"`
	Size     int64    `json:"size"`
	Reason   string   `json:"reason"` // space | age | unused | named
	Error    string   `json:"error,omitempty"`
}

// GCSkipped is a candidate a GC pass kept, and why.
type GCSkipped struct {
	ID  string `json:"id"`
	Why string `json:"why"`
	// Policy names the ImageGCPolicy that kept the image (Why "pinned by ImageGCPolicy"); added field.
	Policy string `json:"policy,omitempty"`
}

// GCResult answers a gc command and is the data of gc.finished.
type GCResult struct {
	Node           string      `json:"node"`
	DryRun         bool        `json:"dryRun"`
	AllUnused      bool        `json:"allUnused,omitempty"`
	CapacityBytes  int64       `json:"capacityBytes"`
	AvailableBytes int64       `json:"availableBytes"`
	UsagePercent   int         `json:"usagePercent"`
	AmountToFree   int64       `json:"amountToFree"`
	FreedBytes     int64       `json:"freedBytes"`
	Removed        []GCRemoved `json:"removed"`
	Skipped        []GCSkipped `json:"skipped"`
	Error          string      `json:"error,omitempty"`
	Started        time.Time   `json:"started"`
	Duration       Duration    `json:"duration"`

	// Added fields (older readers ignore them; older executors leave them unset).

	// Failed lists the removals that failed, with their errors: the entries of Removed whose Error is set
	// (Removed keeps them, for older readers).
	Failed []GCRemoved `json:"failed,omitempty"`
	// MeasuredFreedBytes is what the space pass gave back on the image filesystem as measured (statfs, or the
	// byte quota's sum of listed sizes) after its last removal batch; FreedBytes is the CRI-declared sizes.
	// Not set in a dry run.
	MeasuredFreedBytes int64 `json:"measuredFreedBytes,omitempty"`
	// MeasuredAvailableBytes is the image filesystem's available bytes measured at the end of the space pass.
	MeasuredAvailableBytes int64 `json:"measuredAvailableBytes,omitempty"`
	// Trigger is what started the pass: periodic, usage (the usage check), pull (room before a pull) or
	// manual (a gc command).
	Trigger string `json:"trigger,omitempty"`
	// Policies are the ImageGCPolicy objects (name and generation) whose settings the pass applied, in
	// precedence order; empty: the node's own flags only.
	Policies []GCPolicySource `json:"policies,omitempty"`
}

// Succeeded returns the removals of the result that did not fail.
func (r GCResult) Succeeded() []GCRemoved {
	out := make([]GCRemoved, 0, len(r.Removed))
	for _, rm := range r.Removed {
		if rm.Error == "" {
			out = append(out, rm)
		}
	}
	return out
}

// FailedCount is how many removals of the result failed.
func (r GCResult) FailedCount() int {
	n := 0
	for _, rm := range r.Removed {
		if rm.Error != "" {
			n++
		}
	}
	return n
}

// NodeWarning is the data of node.warning: a Kubernetes Warning event the kubelet posts on its node.
type NodeWarning struct {
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// InUseReply answers imagefleet.qry.<node>.inuse (served by the pod index): the image references named by
// the pods in the node's index (init, regular and ephemeral containers, image volumes), as written in the
// pod specs. The GC executor treats images matching them as in use even before a container exists
// (kubernetes/kubernetes#18140, #123631).
type InUseReply struct {
	Node   string   `json:"node"`
	Images []string `json:"images"`
}
