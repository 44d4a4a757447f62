package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PolicyNodes picks the nodes a standing policy applies to from the fleet's node registry.
type PolicyNodes struct {
	// Selector picks the nodes whose registry labels (the agents' --node-labels) match. Unset or empty: every
	// node of the registry.
	// +optional
	Selector *metav1.LabelSelector `json:"selector,omitempty"`
}

// ImageGCPolicySpec is a standing image GC policy: the settings it sets replace the selected nodes' own
// flags on their running agents; unset settings leave the flags in force.
//
// +kubebuilder:validation:XValidation:rule="has(self.highThresholdPercent) == has(self.lowThresholdPercent)",message="highThresholdPercent and lowThresholdPercent are set together"
// +kubebuilder:validation:XValidation:rule="!has(self.highThresholdPercent) || !has(self.lowThresholdPercent) || self.lowThresholdPercent < self.highThresholdPercent",message="lowThresholdPercent must be less than highThresholdPercent"
// +kubebuilder:validation:XValidation:rule="!has(self.minAge) || !has(self.maxAge) || duration(self.maxAge) == duration('0s') || duration(self.maxAge) > duration(self.minAge)",message="maxAge must be greater than minAge (or 0s: off)"
type ImageGCPolicySpec struct {
	// Nodes are the nodes the policy applies to (default: every node).
	// +kubebuilder:default={}
	// +optional
	Nodes PolicyNodes `json:"nodes"`
	// Priority orders the policies that select one node: for each setting, the highest priority that sets
	// it wins, ties broken by name (the first in alphabetical order wins). Pinned images are added up.
	// +kubebuilder:default=0
	// +optional
	Priority int32 `json:"priority"`
	// HighThresholdPercent is the image filesystem usage at or above which GC frees space
	// (--image-gc-high-threshold). Set with lowThresholdPercent.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	HighThresholdPercent *int32 `json:"highThresholdPercent,omitempty"`
	// LowThresholdPercent is the usage GC frees down to (--image-gc-low-threshold). Set with
	// highThresholdPercent.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	LowThresholdPercent *int32 `json:"lowThresholdPercent,omitempty"`
	// MinAge is the age (since first detected) under which an unused image is kept
	// (--minimum-image-ttl-duration).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s')",message="minAge must not be negative"
	// +optional
	MinAge *metav1.Duration `json:"minAge,omitempty"`
	// MaxAge removes unused images older than this whatever the usage (--image-maximum-gc-age; 0s: off).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s')",message="maxAge must not be negative"
	// +optional
	MaxAge *metav1.Duration `json:"maxAge,omitempty"`
	// CapacityBytes is a byte quota for images (--image-fs-capacity): capacity = this, used = the sum of
	// the image sizes. Bytes or a quantity ("40Gi"); more than 0.
	// +kubebuilder:validation:XValidation:rule="type(self) == int ? self > 0 : quantity(string(self)).isGreaterThan(quantity('0'))",message="capacityBytes must be more than 0"
	// +optional
	CapacityBytes *resource.Quantity `json:"capacityBytes,omitempty"`
	// PinnedImages are references and globs of images GC never removes ('*' any run of characters, '/'
	// included; '?' one), added to the nodes' --pinned-images.
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=512
	// +listType=atomic
	// +optional
	PinnedImages []string `json:"pinnedImages,omitempty"`
	// KeepLastTags keeps, per repository, the images of its newest count tags: by semantic version when
	// every tag of the repository on the node parses as one ("v1.2.3" or "1.2.3"), else by when each image was
	// first detected. Images named by an ImageGC in Named mode are removed all the same.
	// +optional
	KeepLastTags *KeepLastTags `json:"keepLastTags,omitempty"`
	// KeepCopies keeps count copies of every image in the fleet, or in each zone of topologyKey: a node's
	// GC removes an image only when the fleet's copies arbiter grants it, which it does while as many other
	// copies remain (grants are recorded, so two nodes removing at once never both take the same copies).
	// +optional
	KeepCopies *KeepCopies `json:"keepCopies,omitempty"`
}

// KeepCopies is how many copies of each image the fleet, or each zone, keeps.
type KeepCopies struct {
	// Count is how many copies are kept.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	Count int32 `json:"count"`
	// TopologyKey is a node label (the agents' --node-labels) whose value is a zone: count copies are kept
	// in each zone. Unset: the whole fleet is one zone.
	// +kubebuilder:validation:MaxLength=317
	// +optional
	TopologyKey string `json:"topologyKey,omitempty"`
}

// KeepLastTags is how many of each repository's newest tags a node keeps.
type KeepLastTags struct {
	// Count is how many tags of each repository are kept.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	Count int32 `json:"count"`
}

// ImageGCPolicyStatus is what the controller delivered.
type ImageGCPolicyStatus struct {
	// ObservedGeneration is the generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// MatchedNodes counts the registry's nodes the policy selects.
	MatchedNodes int32 `json:"matchedNodes"`
	// AppliedGeneration is the last generation whose spec the controller accepted, the one in force on the
	// selected nodes: while a later generation is refused (Ready False, reason InvalidSpec) the nodes keep
	// this one.
	// +optional
	AppliedGeneration int64 `json:"appliedGeneration,omitempty"`
	// AppliedSpec is the spec of appliedGeneration, kept so that a controller that takes over after a restart
	// keeps it in force while the object's spec is invalid.
	// +optional
	AppliedSpec *ImageGCPolicySpec `json:"appliedSpec,omitempty"`
	// Conditions: Ready (True, reason Applied: every selected node's effective policy is written for this
	// generation; False, reason InvalidSpec: this generation is refused and appliedGeneration stays in force,
	// ConflictingPolicies: on some selected node this policy's settings merge with another policy's into an
	// invalid configuration (minAge not less than maxAge), which is not written there, or WriteFailed).
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Condition type and reasons of an ImageGCPolicy.
const (
	ConditionReady = "Ready"

	ReasonApplied     = "Applied"
	ReasonInvalidSpec = "InvalidSpec"
	ReasonWriteFailed = "WriteFailed"
	// ReasonConflictingPolicies: the policy's settings, merged with another policy's on some selected node,
	// make a configuration the node would refuse; that node's merge is not written.
	ReasonConflictingPolicies = "ConflictingPolicies"
)

// ImageGCPolicy is the standing image GC policy of the nodes it selects, applied to their running agents.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=igcp,categories=imagefleet
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Priority",type=integer,JSONPath=`.spec.priority`
// +kubebuilder:printcolumn:name="Nodes",type=integer,JSONPath=`.status.matchedNodes`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="High",type=integer,JSONPath=`.spec.highThresholdPercent`,priority=1
// +kubebuilder:printcolumn:name="Low",type=integer,JSONPath=`.spec.lowThresholdPercent`,priority=1
// +kubebuilder:printcolumn:name="Capacity",type=string,JSONPath=`.spec.capacityBytes`,priority=1
// +kubebuilder:printcolumn:name="Pinned",type=string,JSONPath=`.spec.pinnedImages`,priority=1
// +kubebuilder:printcolumn:name="Keep-Tags",type=integer,JSONPath=`.spec.keepLastTags.count`,priority=1
// +kubebuilder:printcolumn:name="Keep-Copies",type=integer,JSONPath=`.spec.keepCopies.count`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImageGCPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +kubebuilder:default={}
	// +optional
	Spec   ImageGCPolicySpec   `json:"spec"`
	Status ImageGCPolicyStatus `json:"status,omitempty"`
}

// ImageGCPolicyList is a list of ImageGCPolicies.
//
// +kubebuilder:object:root=true
type ImageGCPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImageGCPolicy `json:"items"`
}
