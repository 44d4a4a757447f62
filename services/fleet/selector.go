package fleet

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/imagefleet/imagefleet/events"
)

// ParseSelector parses a label selector (the Kubernetes syntax: k=v, k!=v, k in (a,b), !k, ...). The empty
// string selects everything.
func ParseSelector(s string) (labels.Selector, error) {
	sel, err := labels.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("parse selector %q: %w", s, err)
	}
	return sel, nil
}

// selectNodes picks the nodes whose labels match sel, in name order. Lost nodes are returned apart (skipped)
// unless includeLost, in which case they are planned like the rest (and will fail if they do not answer).
func selectNodes(nodes []events.NodeStatus, sel labels.Selector, includeLost bool) (chosen []string, skipped []events.RolloutNodeError) {
	sorted := append([]events.NodeStatus(nil), nodes...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Node < sorted[j].Node })
	for _, n := range sorted {
		if !sel.Matches(labels.Set(n.Labels)) {
			continue
		}
		if n.State != events.NodeReady && !includeLost {
			skipped = append(skipped, events.RolloutNodeError{Node: n.Node,
				Error: fmt.Sprintf("node is %s (last heartbeat %s ago)", n.State, n.Age.Round(time.Second))})
			continue
		}
		chosen = append(chosen, n.Node)
	}
	return chosen, skipped
}

// ParseLabels parses --node-labels: k=v pairs separated by commas, with Kubernetes label key and value rules.
func ParseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("label %q is not key=value", kv)
		}
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return nil, fmt.Errorf("label key %q: %s", k, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, fmt.Errorf("label value %q of %s: %s", v, k, strings.Join(errs, "; "))
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("label %q given twice", k)
		}
		out[k] = v
	}
	return out, nil
}
