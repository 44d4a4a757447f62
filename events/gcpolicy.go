package events

import (
	"errors"
	"fmt"
	"strings"
)

// GCPolicy is a node's effective ImageGCPolicy, the value of its key in GCPolicyBucket: the settings the
// selecting policies set, merged by precedence (docs/gc-policies.md). An unset field leaves the node's own
// flag in force.
type GCPolicy struct {
	// Sources are the policies that selected the node, highest precedence first.
	Sources []GCPolicySource `json:"sources"`

	HighThresholdPercent *int      `json:"highThresholdPercent,omitempty"`
	LowThresholdPercent  *int      `json:"lowThresholdPercent,omitempty"`
	MinAge               *Duration `json:"minAge,omitempty"`
	MaxAge               *Duration `json:"maxAge,omitempty"`
	// CapacityBytes is a byte quota for images (as --image-fs-capacity); set, it is > 0.
	CapacityBytes *int64 `json:"capacityBytes,omitempty"`
	// Pinned are the policies' pinned images (references and globs, as --pinned-images), per policy: added
	// to the node's own.
	Pinned []GCPolicyPins `json:"pinned,omitempty"`
	// KeepLastTags keeps, per repository, the images of its newest Count tags (added field).
	KeepLastTags *GCKeepLastTags `json:"keepLastTags,omitempty"`
	// KeepCopies keeps Count copies of every image in the fleet, or in the node's zone (added field).
	KeepCopies *GCKeepCopies `json:"keepCopies,omitempty"`
}

// GCKeepCopies is a policy's keepCopies as one node applies it.
type GCKeepCopies struct {
	Count int `json:"count"`
	// TopologyKey is the node label whose value is a zone ("": the whole fleet is one zone); Zone is this
	// node's value of it, as the registry shows its labels.
	TopologyKey string `json:"topologyKey,omitempty"`
	Zone        string `json:"zone,omitempty"`
	Policy      string `json:"policy"`
}

// CopiesRequest asks the fleet's copies arbiter (CopiesSubject) which of Images Node may remove without
// leaving fewer than Count copies of one in its zone. Without DryRun the allowed removals are recorded in
// GCCopiesBucket, so a concurrent request counts them as gone. It is sent on Node's own CopiesSubject: the
// arbiter refuses one whose Node is not the subject's.
type CopiesRequest struct {
	Node        string   `json:"node"`
	Images      []string `json:"images"`
	Count       int      `json:"count"`
	TopologyKey string   `json:"topologyKey,omitempty"`
	Zone        string   `json:"zone,omitempty"`
	DryRun      bool     `json:"dryRun,omitempty"`
	// Release gives back Node's grants of Images, whose removal failed, so its copies count again at once
	// (added field; Count, TopologyKey and Zone are not read). Its reply is empty.
	Release bool `json:"release,omitempty"`
}

// CopiesReply lists the images of a CopiesRequest that may go; Copies holds, for each image asked about,
// the copies the arbiter counted in the zone (this node's included).
type CopiesReply struct {
	Allowed []string       `json:"allowed"`
	Copies  map[string]int `json:"copies"`
}

// GCKeepLastTags is a policy's keepLastTags, with the policy that set it.
type GCKeepLastTags struct {
	Count  int    `json:"count"`
	Policy string `json:"policy"`
}

// GCPolicySource names one ImageGCPolicy object at one generation.
type GCPolicySource struct {
	Name       string `json:"name"`
	Generation int64  `json:"generation"`
}

// String is name/generation.
func (s GCPolicySource) String() string { return fmt.Sprintf("%s/%d", s.Name, s.Generation) }

// GCPolicyPins are the pinned images one policy adds.
type GCPolicyPins struct {
	Policy string   `json:"policy"`
	Images []string `json:"images"`
}

// Validate checks what a node can check alone: ranges and shapes. The combination with the node's own flags
// (low below high) is the executor's to check.
func (p GCPolicy) Validate() error {
	var errs []error
	if p.HighThresholdPercent != nil && (*p.HighThresholdPercent < 0 || *p.HighThresholdPercent > 100) {
		errs = append(errs, fmt.Errorf("highThresholdPercent %d must be between 0 and 100", *p.HighThresholdPercent))
	}
	if p.LowThresholdPercent != nil && (*p.LowThresholdPercent < 0 || *p.LowThresholdPercent > 100) {
		errs = append(errs, fmt.Errorf("lowThresholdPercent %d must be between 0 and 100", *p.LowThresholdPercent))
	}
	if p.MinAge != nil && p.MinAge.Duration < 0 {
		errs = append(errs, fmt.Errorf("minAge %v must not be negative", p.MinAge.Duration))
	}
	if p.MaxAge != nil && p.MaxAge.Duration < 0 {
		errs = append(errs, fmt.Errorf("maxAge %v must not be negative", p.MaxAge.Duration))
	}
	if p.CapacityBytes != nil && *p.CapacityBytes <= 0 {
		errs = append(errs, fmt.Errorf("capacityBytes %d must be positive", *p.CapacityBytes))
	}
	for _, pp := range p.Pinned {
		if pp.Policy == "" {
			errs = append(errs, errors.New("pinned images without their policy's name"))
		}
		for _, im := range pp.Images {
			if im == "" || len(im) > 512 || strings.ContainsAny(im, " \t\n") {
				errs = append(errs, fmt.Errorf("pinned image %q of policy %s must be 1-512 characters without spaces", im, pp.Policy))
			}
		}
	}
	if k := p.KeepLastTags; k != nil && (k.Count < 1 || k.Policy == "") {
		errs = append(errs, fmt.Errorf("keepLastTags count %d must be at least 1, with its policy's name", k.Count))
	}
	if k := p.KeepCopies; k != nil && (k.Count < 1 || k.Policy == "") {
		errs = append(errs, fmt.Errorf("keepCopies count %d must be at least 1, with its policy's name", k.Count))
	}
	return errors.Join(errs...)
}

// Names is the sources as "name/generation" joined by commas (logs).
func (p GCPolicy) Names() string {
	out := make([]string, len(p.Sources))
	for i, s := range p.Sources {
		out[i] = s.String()
	}
	return strings.Join(out, ",")
}
