package controller

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/distribution/reference"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/events"
)

// checkedPolicy is an ImageGCPolicy whose spec passed checkPolicy, with its parsed selector.
type checkedPolicy struct {
	obj *v1alpha1.ImageGCPolicy
	sel labels.Selector
}

// checkPolicy checks what the schema cannot: the selector and the pinned references (as the agents parse
// --pinned-images); and the quota's value, which the schema refuses too, for an object stored before it did
// (the API server lets an unchanged value through a new rule). A generation that fails is left out of every
// node's merge; the sync keeps the policy's last valid one in force instead (policySync.lastValid).
func checkPolicy(p *v1alpha1.ImageGCPolicy) (checkedPolicy, error) {
	sel := labels.Everything()
	if s := p.Spec.Nodes.Selector; s != nil {
		var err error
		if sel, err = metav1.LabelSelectorAsSelector(s); err != nil {
			return checkedPolicy{}, fmt.Errorf("nodes.selector: %w", err)
		}
	}
	var errs []error
	if q := p.Spec.CapacityBytes; q != nil && q.Value() <= 0 {
		errs = append(errs, fmt.Errorf("capacityBytes %s must be more than 0", q.String()))
	}
	for _, im := range p.Spec.PinnedImages {
		im = strings.TrimSpace(im)
		if im == "" || strings.ContainsAny(im, "*?") || isImageID(im) {
			continue
		}
		if _, err := reference.ParseNormalizedNamed(im); err != nil {
			errs = append(errs, fmt.Errorf("pinnedImages: image %q is neither a reference nor an image ID: %w", im, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return checkedPolicy{}, err
	}
	return checkedPolicy{obj: p, sel: sel}, nil
}

func isImageID(s string) bool {
	hex := strings.TrimPrefix(s, "sha256:")
	if len(hex) != 64 {
		return false
	}
	return strings.Trim(hex, "0123456789abcdef") == ""
}

// precedes orders policies by precedence: higher priority first, then name.
func precedes(a, b *v1alpha1.ImageGCPolicy) int {
	if a.Spec.Priority != b.Spec.Priority {
		if a.Spec.Priority > b.Spec.Priority {
			return -1
		}
		return 1
	}
	return strings.Compare(a.Name, b.Name)
}

// effectivePolicy merges the policies that select one node: for each setting the first policy in
// precedence order (priority descending, then name) that sets it wins. The two thresholds are one setting
// (the schema sets them together), so a node never gets one policy's high with another's low. Pinned
// images are added up, each pattern under the first policy (in precedence order) that lists it. nil when
// no policy is given.
//
// keepCopies carries the node's zone: its value of the winning policy's topologyKey in nodeLabels.
func effectivePolicy(ps []*v1alpha1.ImageGCPolicy, nodeLabels map[string]string) *events.GCPolicy {
	if len(ps) == 0 {
		return nil
	}
	ps = slices.Clone(ps)
	slices.SortFunc(ps, precedes)
	out := &events.GCPolicy{Sources: make([]events.GCPolicySource, 0, len(ps))}
	seen := map[string]bool{}
	for _, p := range ps {
		s := p.Spec
		out.Sources = append(out.Sources, events.GCPolicySource{Name: p.Name, Generation: p.Generation})
		if out.HighThresholdPercent == nil && s.HighThresholdPercent != nil && s.LowThresholdPercent != nil {
			h, l := int(*s.HighThresholdPercent), int(*s.LowThresholdPercent)
			out.HighThresholdPercent, out.LowThresholdPercent = &h, &l
		}
		if out.MinAge == nil && s.MinAge != nil {
			out.MinAge = &events.Duration{Duration: s.MinAge.Duration}
		}
		if out.MaxAge == nil && s.MaxAge != nil {
			out.MaxAge = &events.Duration{Duration: s.MaxAge.Duration}
		}
		if out.CapacityBytes == nil && s.CapacityBytes != nil {
			v := s.CapacityBytes.Value()
			out.CapacityBytes = &v
		}
		if out.KeepCopies == nil && s.KeepCopies != nil {
			out.KeepCopies = &events.GCKeepCopies{Count: int(s.KeepCopies.Count), TopologyKey: s.KeepCopies.TopologyKey,
				Zone: nodeLabels[s.KeepCopies.TopologyKey], Policy: p.Name}
		}
		if out.KeepLastTags == nil && s.KeepLastTags != nil {
			out.KeepLastTags = &events.GCKeepLastTags{Count: int(s.KeepLastTags.Count), Policy: p.Name}
		}
		var pins []string
		for _, im := range s.PinnedImages {
			if im = strings.TrimSpace(im); im != "" && !seen[im] {
				seen[im] = true
				pins = append(pins, im)
			}
		}
		if len(pins) > 0 {
			out.Pinned = append(out.Pinned, events.GCPolicyPins{Policy: p.Name, Images: pins})
		}
	}
	return out
}

// mergeConflict is a node's merge that the node would refuse: fields from policies set it, err says why.
type mergeConflict struct {
	fields   string   // the field pair, "minAge/maxAge"
	policies []string // the policies that set them, in precedence order, each once
	err      error
}

// checkMerge checks the settings effectivePolicy merges from ps as the node checks its merged configuration
// (services/gc's Config.Validate over its flags with the policy over them), for the rules that relate two
// settings: a node that refuses a delivered policy keeps its last good one, so a merge it would refuse must
// not be written. A mirror, not an import: the controller is part of the fleet worker, and workers do not
// import each other (internal/archtest); TestCheckMergeAgreesWithTheNode keeps the two in step.
//
// Only what the policies set is checked: a setting the node takes from its own flags (a policy's maxAge
// under the node's --minimum-image-ttl-duration) is not known here, and the node still refuses that one.
// The thresholds are one setting taken from one policy, whose schema orders them: they are checked all the
// same (a policy stored before the schema's rule). The ages, which two policies can set, are the pair that
// can conflict between policies.
func checkMerge(ps []*v1alpha1.ImageGCPolicy) *mergeConflict {
	ps = slices.Clone(ps)
	slices.SortFunc(ps, precedes)
	var minFrom, maxFrom, thrFrom *v1alpha1.ImageGCPolicy
	for _, p := range ps {
		s := p.Spec
		if minFrom == nil && s.MinAge != nil {
			minFrom = p
		}
		if maxFrom == nil && s.MaxAge != nil {
			maxFrom = p
		}
		if thrFrom == nil && s.HighThresholdPercent != nil && s.LowThresholdPercent != nil {
			thrFrom = p
		}
	}
	if thrFrom != nil {
		if h, l := *thrFrom.Spec.HighThresholdPercent, *thrFrom.Spec.LowThresholdPercent; l >= h {
			return &mergeConflict{fields: "lowThresholdPercent/highThresholdPercent", policies: []string{thrFrom.Name},
				err: fmt.Errorf("lowThresholdPercent %d (policy %s) must be less than highThresholdPercent %d", l, thrFrom.Name, h)}
		}
	}
	if minFrom != nil && maxFrom != nil {
		lo, hi := minFrom.Spec.MinAge.Duration, maxFrom.Spec.MaxAge.Duration
		if hi > 0 && hi <= lo {
			c := &mergeConflict{fields: "minAge/maxAge", policies: []string{minFrom.Name},
				err: fmt.Errorf("maxAge %v (policy %s) must be greater than minAge %v (policy %s) or 0s", hi, maxFrom.Name, lo, minFrom.Name)}
			if maxFrom != minFrom {
				c.policies = append(c.policies, maxFrom.Name)
			}
			return c
		}
	}
	return nil
}
