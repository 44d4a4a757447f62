package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// NodeSelection picks a rollout's nodes from the fleet's node registry. Empty: every Ready node.
//
// +kubebuilder:validation:XValidation:rule="!(has(self.selector) && has(self.names))",message="selector and names exclude each other"
type NodeSelection struct {
	// Selector picks the nodes whose registry labels (the agents' --node-labels) match. Lost nodes are left
	// out (counted as skipped) unless includeLost.
	// +optional
	Selector *metav1.LabelSelector `json:"selector,omitempty"`
	// Names are exactly these nodes, in this order, whatever the registry shows.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=10000
	// +kubebuilder:validation:items:MaxLength=253
	Names []string `json:"names,omitempty"`
	// IncludeLost also acts on the nodes the registry shows as lost (they fail if they do not answer).
	// +optional
	IncludeLost bool `json:"includeLost,omitempty"`
}

// Waves is the slow start: the first wave's size, each next wave twice the last, a wave starting only once
// every node of the one before has ended.
type Waves struct {
	// InitialBatch is the first wave's size.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +optional
	InitialBatch int32 `json:"initialBatch,omitempty"`
	// MaxInFlight caps the nodes acted on at once inside a wave. It may be changed while the object runs:
	// the new value applies from the next wave.
	// +kubebuilder:default=1000
	// +kubebuilder:validation:Minimum=1
	// +optional
	MaxInFlight int32 `json:"maxInFlight,omitempty"`
}

// RolloutSpec is what an ImagePrePull and an ImageGC share.
type RolloutSpec struct {
	// Nodes are the nodes to act on (default: every Ready node).
	// +kubebuilder:default={}
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="nodes are immutable"
	// +optional
	Nodes NodeSelection `json:"nodes"`
	// Waves are the slow start's sizes.
	// +kubebuilder:default={initialBatch: 1, maxInFlight: 1000}
	// +kubebuilder:validation:XValidation:rule="self.initialBatch == oldSelf.initialBatch",message="waves.initialBatch is immutable"
	// +optional
	Waves Waves `json:"waves"`
	// FailureBudget is how many of the planned nodes may fail before no new wave starts: a count (10) or a
	// whole percentage of the planned nodes ("5%", rounded down). 0 stops after the first wave with a
	// failure.
	// +kubebuilder:default=0
	// +kubebuilder:validation:XIntOrString
	// +kubebuilder:validation:XValidation:rule="type(self) == int ? self >= 0 : self.matches('^[0-9]+%$') && int(self.replace('%', '')) <= 100",message="failureBudget must be a count of at least 0 or a percentage like \"5%\""
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="failureBudget is immutable"
	// +optional
	FailureBudget intstr.IntOrString `json:"failureBudget"`
	// NodeTimeout bounds each node's work; a node that does not answer in time has failed.
	// +kubebuilder:default="60s"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s')",message="nodeTimeout must be at least 1s"
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="nodeTimeout is immutable"
	// +optional
	NodeTimeout *metav1.Duration `json:"nodeTimeout,omitempty"`
	// Paused keeps the next wave from starting (the running one ends). Set it back to false to go on.
	// +optional
	Paused bool `json:"paused,omitempty"`
	// TTLSecondsAfterFinished deletes the object this long after it completed or failed (default: kept).
	// +kubebuilder:validation:Minimum=0
	// +optional
	TTLSecondsAfterFinished *int32 `json:"ttlSecondsAfterFinished,omitempty"`
}

// ImagePrePullSpec is what an ImagePrePull pulls, where.
//
// +kubebuilder:validation:XValidation:rule="!has(self.readinessTaint) || (has(self.completionPolicy) && self.completionPolicy == 'KeepNewNodes')",message="readinessTaint goes with completionPolicy KeepNewNodes"
// +kubebuilder:validation:XValidation:rule="!has(self.ttlSecondsAfterFinished) || !has(self.completionPolicy) || self.completionPolicy != 'KeepNewNodes'",message="ttlSecondsAfterFinished does not apply to completionPolicy KeepNewNodes"
type ImagePrePullSpec struct {
	// Images are pulled on each node, in this order.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=512
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="images are immutable"
	// +listType=atomic
	Images []string `json:"images"`
	// PullPolicy is the kubelet's: IfNotPresent (an image already on the node counts as a success) or
	// Always.
	// +kubebuilder:default=IfNotPresent
	// +kubebuilder:validation:Enum=IfNotPresent;Always
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="pullPolicy is immutable"
	// +optional
	PullPolicy string `json:"pullPolicy,omitempty"`
	// AllowPrivate lets the pull use the nodes' registry credentials (the agents' --node-keyring). Pulled
	// without the kubelet, such an image has no kubelet pull record: every pod on the node may use it
	// (docs/kubernetes.md). Off: a private image fails.
	// +kubebuilder:default=false
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="allowPrivate is immutable"
	// +optional
	AllowPrivate bool `json:"allowPrivate,omitempty"`
	// CompletionPolicy is Once (the planned nodes are warmed once and the object completes) or
	// KeepNewNodes (the planned nodes are warmed once, the object completes, and from then on every node
	// that joins the fleet and matches nodes is warmed as it joins; docs/kubernetes-objects.md, "New nodes").
	// +kubebuilder:default=Once
	// +kubebuilder:validation:Enum=Once;KeepNewNodes
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="completionPolicy is immutable"
	// +optional
	CompletionPolicy string `json:"completionPolicy,omitempty"`
	// ReadinessTaint is the key of the taint the controller removes from a Kubernetes Node once every
	// KeepNewNodes ImagePrePull with this key that selects the node has warmed it (default
	// readiness.k8s.io/imagefleet-prepull). Only with completionPolicy KeepNewNodes.
	// +kubebuilder:validation:MaxLength=316
	// +kubebuilder:validation:Pattern=`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="readinessTaint is immutable"
	// +optional
	ReadinessTaint string `json:"readinessTaint,omitempty"`

	RolloutSpec `json:",inline"`
}

// ImageGCSpec is what an ImageGC runs, where.
//
// +kubebuilder:validation:XValidation:rule="!has(self.mode) || (self.mode == 'Named') == has(self.images)",message="mode Named goes with images, and images with mode Named"
// +kubebuilder:validation:XValidation:rule="has(self.mode) == has(oldSelf.mode) && has(self.images) == has(oldSelf.images)",message="mode and images are immutable"
// +kubebuilder:validation:XValidation:rule="has(self.schedule) == has(oldSelf.schedule)",message="schedule may be changed but not added or removed"
// +kubebuilder:validation:XValidation:rule="!has(self.timeZone) || has(self.schedule)",message="timeZone goes with schedule"
// +kubebuilder:validation:XValidation:rule="!has(self.window) || has(self.schedule)",message="window goes with schedule"
// +kubebuilder:validation:XValidation:rule="!has(self.schedule) || !has(self.ttlSecondsAfterFinished)",message="a scheduled ImageGC never finishes: ttlSecondsAfterFinished does not apply"
type ImageGCSpec struct {
	// Mode is KubeletPolicy (the kubelet's pass: free down to the low threshold, oldest unused first, and
	// every unused image past its maximum age), AllUnused (every eligible unused image, the kubelet's
	// DeleteUnusedImages) or Named (every unused image that images names, however young). Unset: Named with
	// images, else KubeletPolicy.
	// +kubebuilder:validation:Enum=KubeletPolicy;AllUnused;Named
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="mode is immutable"
	// +optional
	Mode string `json:"mode,omitempty"`
	// Images are removed from every node where no container uses them (and no pin keeps them), whatever
	// their age and the disk's usage: references ("registry.example/app:1.2"), image IDs or digests
	// ("sha256:..."), or globs ('*' any run of characters, '/' included; '?' one).
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=512
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="images are immutable"
	// +listType=atomic
	// +optional
	Images []string `json:"images,omitempty"`
	// DryRun reports, node by node, what would be removed and the bytes it would free, and removes nothing.
	// +kubebuilder:default=false
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="dryRun is immutable"
	// +optional
	DryRun bool `json:"dryRun,omitempty"`
	// Policy overrides the nodes' own GC policy for this pass.
	// +kubebuilder:default={}
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="policy is immutable"
	// +optional
	Policy GCPolicyOverrides `json:"policy"`
	// Schedule runs the GC again and again, as a CronJob runs Jobs: a cron expression with a CronJob's
	// syntax (5 fields, or @hourly, @daily, @weekly, @monthly, @yearly). Each firing is one rollout; the
	// object never completes. It may be changed (from the next firing) but not added or removed.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:XValidation:rule="!self.contains('TZ')",message="schedule must not set a time zone (TZ= or CRON_TZ=): use timeZone"
	// +optional
	Schedule string `json:"schedule,omitempty"`
	// TimeZone is the IANA time zone the schedule is read in ("Europe/Berlin"; default UTC).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:XValidation:rule="self != 'Local'",message="timeZone must name a time zone, not Local"
	// +optional
	TimeZone string `json:"timeZone,omitempty"`
	// Window bounds each scheduled run: no wave starts once this long has passed since the firing's time
	// (the wave at work ends), and a firing that could not start within it is skipped (without a window:
	// within 1m).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1m')",message="window must be at least 1m"
	// +optional
	Window *metav1.Duration `json:"window,omitempty"`

	RolloutSpec `json:",inline"`
}

// GCPolicyOverrides are the kubelet's image GC settings, for one pass. Unset: the node's own.
//
// +kubebuilder:validation:XValidation:rule="!has(self.highThresholdPercent) || !has(self.lowThresholdPercent) || self.lowThresholdPercent < self.highThresholdPercent",message="lowThresholdPercent must be less than highThresholdPercent"
type GCPolicyOverrides struct {
	// HighThresholdPercent is the image filesystem usage at or above which the pass frees space.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	HighThresholdPercent *int32 `json:"highThresholdPercent,omitempty"`
	// LowThresholdPercent is the usage the pass frees down to.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	LowThresholdPercent *int32 `json:"lowThresholdPercent,omitempty"`
	// MinAge is the age (since first detected) under which an unused image is kept.
	// +optional
	MinAge *metav1.Duration `json:"minAge,omitempty"`
	// MaxAge removes unused images older than this whatever the usage (0s: off).
	// +optional
	MaxAge *metav1.Duration `json:"maxAge,omitempty"`
}

// RolloutStatus is the status of an ImagePrePull or an ImageGC. The controller writes it when a wave
// starts, when a node fails (the first 20), at most every few seconds while nodes end, and at the end:
// O(waves + failures) writes, whatever the fleet's size.
type RolloutStatus struct {
	// ObservedGeneration is the generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Phase is Running, Paused, Complete or Failed (the conditions say why); a scheduled ImageGC's is
	// Scheduled between runs and Running or Paused during one.
	// +optional
	Phase string `json:"phase,omitempty"`
	// Conditions are Progressing, Paused, Complete and Failed.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// RolloutID is the fleet rollout on the bus (imagefleet fleet follow ID).
	// +optional
	RolloutID string `json:"rolloutID,omitempty"`
	// Desired counts the planned nodes.
	Desired int32 `json:"desired"`
	// Active counts the nodes of the current wave still at work.
	Active int32 `json:"active"`
	// Succeeded counts the nodes that succeeded (an image already present is a success).
	Succeeded int32 `json:"succeeded"`
	// Failed counts the nodes that failed.
	Failed int32 `json:"failed"`
	// Skipped counts the matching nodes left out of the plan (lost ones).
	Skipped int32 `json:"skipped"`
	// Joined counts the nodes an ImagePrePull with completionPolicy KeepNewNodes took on after its first
	// rollout, as they joined the fleet; desired, succeeded and failed count them too.
	// +optional
	Joined int32 `json:"joined,omitempty"`
	// Progress is "<ended>/<desired>", for kubectl get.
	// +optional
	Progress string `json:"progress,omitempty"`
	// CurrentWave is the index of the wave at work (1 is the first).
	// +optional
	CurrentWave int32 `json:"currentWave,omitempty"`
	// Waves are the planned wave sizes.
	// +optional
	// +listType=atomic
	Waves []int32 `json:"waves,omitempty"`
	// BytesFreed sums what an ImageGC removed (a dry run: would remove).
	// +optional
	BytesFreed int64 `json:"bytesFreed,omitempty"`
	// ImagesRemoved counts what an ImageGC removed (a dry run: would remove).
	// +optional
	ImagesRemoved int64 `json:"imagesRemoved,omitempty"`
	// StartTime is when the rollout started.
	// +optional
	StartTime *metav1.Time `json:"startTime,omitempty"`
	// CompletionTime is when it completed or failed.
	// +optional
	CompletionTime *metav1.Time `json:"completionTime,omitempty"`
	// FailedNodes are the first 20 failed nodes with their reasons (the rest: imagefleet fleet follow ID).
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=20
	FailedNodes []NodeFailure `json:"failedNodes,omitempty"`
	// LastScheduleTime is the firing time of a scheduled ImageGC's latest run (the counters above describe
	// that run).
	// +optional
	LastScheduleTime *metav1.Time `json:"lastScheduleTime,omitempty"`
	// NextScheduleTime is a scheduled ImageGC's next firing time.
	// +optional
	NextScheduleTime *metav1.Time `json:"nextScheduleTime,omitempty"`
}

// NodeFailure is a failed node and why.
type NodeFailure struct {
	Node   string `json:"node"`
	Reason string `json:"reason"`
}

// Condition types and phases.
const (
	ConditionProgressing = "Progressing"
	ConditionPaused      = "Paused"
	ConditionComplete    = "Complete"
	ConditionFailed      = "Failed"
	// ConditionScheduled and ConditionLastRunComplete are a scheduled ImageGC's: its schedule is valid, and
	// its latest run ran every wave.
	ConditionScheduled       = "Scheduled"
	ConditionLastRunComplete = "LastRunComplete"

	CompletionOnce         = "Once"
	CompletionKeepNewNodes = "KeepNewNodes"
	// DefaultReadinessTaint is spec.readinessTaint's default.
	DefaultReadinessTaint = "readiness.k8s.io/imagefleet-prepull"

	PhaseRunning  = "Running"
	PhasePaused   = "Paused"
	PhaseComplete = "Complete"
	PhaseFailed   = "Failed"
	// PhaseScheduled: a scheduled ImageGC between runs.
	PhaseScheduled = "Scheduled"
)

// ImagePrePull pulls images on a fleet's nodes in slow-start waves.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=ipp,categories=imagefleet
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Status",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Completions",type=string,JSONPath=`.status.progress`
// +kubebuilder:printcolumn:name="Failed",type=integer,JSONPath=`.status.failed`
// +kubebuilder:printcolumn:name="Wave",type=integer,JSONPath=`.status.currentWave`
// +kubebuilder:printcolumn:name="Images",type=string,JSONPath=`.spec.images`,priority=1
// +kubebuilder:printcolumn:name="Rollout",type=string,JSONPath=`.status.rolloutID`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImagePrePull struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ImagePrePullSpec `json:"spec"`
	Status RolloutStatus    `json:"status,omitempty"`
}

// ImagePrePullList is a list of ImagePrePulls.
//
// +kubebuilder:object:root=true
type ImagePrePullList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImagePrePull `json:"items"`
}

// ImageGC runs image GC on a fleet's nodes in slow-start waves.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=igc,categories=imagefleet
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Status",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Completions",type=string,JSONPath=`.status.progress`
// +kubebuilder:printcolumn:name="Failed",type=integer,JSONPath=`.status.failed`
// +kubebuilder:printcolumn:name="Freed",type=integer,JSONPath=`.status.bytesFreed`
// +kubebuilder:printcolumn:name="Schedule",type=string,JSONPath=`.spec.schedule`
// +kubebuilder:printcolumn:name="Last-Schedule",type=date,JSONPath=`.status.lastScheduleTime`
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.spec.mode`,priority=1
// +kubebuilder:printcolumn:name="Images",type=string,JSONPath=`.spec.images`,priority=1
// +kubebuilder:printcolumn:name="Dry-Run",type=boolean,JSONPath=`.spec.dryRun`,priority=1
// +kubebuilder:printcolumn:name="Rollout",type=string,JSONPath=`.status.rolloutID`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImageGC struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +kubebuilder:default={}
	// +optional
	Spec   ImageGCSpec   `json:"spec"`
	Status RolloutStatus `json:"status,omitempty"`
}

// ImageGCList is a list of ImageGCs.
//
// +kubebuilder:object:root=true
type ImageGCList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImageGC `json:"items"`
}
