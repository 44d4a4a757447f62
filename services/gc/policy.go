package gc

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// The node's ImageGCPolicy (docs/gc-policies.md). The fleet controller writes the node's effective policy
// to its key in events.GCPolicyBucket and announces the key's new revision; the executor reads that key
// (watchPolicy) and applies the policy from its next pass, without a restart: the node's flags (Config) overridden by the fields the policy sets, its pinned
// images added to --pinned-images. A delivered policy that would make an invalid configuration (Config.Validate
// over the merged settings, as if they were the agent's flags) is refused with an error log and the last good
// one is kept. A deleted key restores the flags. While NATS is away the last policy received stays in force.
//
// The periodic loop's on/off state is decided at start from the flags (HighThresholdPercent 100 and MaxAge
// 0 disable it, as in the kubelet); a policy changes the thresholds of passes, not whether the loop runs.

// WhyPinnedByGCPolicy is why a pass kept an image one of the node's ImageGCPolicy objects pins
// (events.GCSkipped.Policy names the policy).
const WhyPinnedByGCPolicy = "pinned by ImageGCPolicy"

// EnsurePolicyBucket creates the ImageGCPolicy bucket: what `imagefleet bus init` runs with the admin
// identity (node identities may only read their key; the controller also makes it when missing).
func EnsurePolicyBucket(ctx context.Context, b *bus.Bus) error {
	_, err := b.KV(ctx, PolicyBucketConfig())
	return err
}

// PolicyBucketConfig is the ImageGCPolicy bucket's configuration, the same for every opener.
func PolicyBucketConfig() bus.KVConfig {
	return bus.KVConfig{Bucket: events.GCPolicyBucket, Description: events.GCPolicyBucketDescription}
}

// policyPins are one ImageGCPolicy's pinned images.
type policyPins struct {
	policy string
	m      *refMatcher
}

// appliedPolicy is the delivered policy in force.
type appliedPolicy struct {
	val      events.GCPolicy
	rev      uint64
	pins     []policyPins
	keepLast *keepLast
}

// settings are what one pass applies: the flags with the policy's fields over them.
type settings struct {
	policy     Policy
	capacity   int64 // the policy's byte quota (0: the flags')
	pins       []policyPins
	keepLast   *keepLast
	keepCopies *events.GCKeepCopies
	sources    []events.GCPolicySource
}

// policyState holds the applied policy; the watcher writes it, passes read it.
type policyState struct {
	mu  sync.Mutex
	cur *appliedPolicy
}

func (s *Service) settings() settings {
	s.policy.mu.Lock()
	cur := s.policy.cur
	s.policy.mu.Unlock()
	st := settings{policy: s.cfg.Policy}
	if cur == nil {
		return st
	}
	merged, _ := mergePolicy(s.cfg, cur.val) // validated when applied
	st.policy, st.pins, st.keepLast, st.keepCopies, st.sources = merged.Policy, cur.pins, cur.keepLast, cur.val.KeepCopies, cur.val.Sources
	if cur.val.CapacityBytes != nil {
		st.capacity = *cur.val.CapacityBytes
	}
	return st
}

// mergePolicy returns the node's configuration with the policy's set fields over it, and its pinned images
// added, checked as the agent's flags are.
func mergePolicy(cfg Config, p events.GCPolicy) (Config, error) {
	if err := p.Validate(); err != nil {
		return Config{}, err
	}
	if p.HighThresholdPercent != nil {
		cfg.Policy.HighThresholdPercent = *p.HighThresholdPercent
	}
	if p.LowThresholdPercent != nil {
		cfg.Policy.LowThresholdPercent = *p.LowThresholdPercent
	}
	if p.MinAge != nil {
		cfg.Policy.MinAge = p.MinAge.Duration
	}
	if p.MaxAge != nil {
		cfg.Policy.MaxAge = p.MaxAge.Duration
	}
	if p.CapacityBytes != nil {
		cfg.CapacityBytes = *p.CapacityBytes
	}
	cfg.PinnedImages = slices.Clone(cfg.PinnedImages)
	for _, pp := range p.Pinned {
		cfg.PinnedImages = append(cfg.PinnedImages, pp.Images...)
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// applyPolicy decodes, checks and applies a delivered value; an invalid one is refused (returned) and the
// policy in force stays.
func (s *Service) applyPolicy(raw []byte, rev uint64) error {
	var p events.GCPolicy
	if err := json.Unmarshal(raw, &p); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if _, err := mergePolicy(s.cfg, p); err != nil {
		return fmt.Errorf("policy %s: %w", p.Names(), err)
	}
	a := &appliedPolicy{val: p, rev: rev}
	if k := p.KeepLastTags; k != nil {
		a.keepLast = &keepLast{count: k.Count, policy: k.Policy}
	}
	for _, pp := range p.Pinned {
		m, _ := newRefMatcher(pp.Images, true) // checked by mergePolicy
		a.pins = append(a.pins, policyPins{policy: pp.Policy, m: m})
	}
	s.policy.mu.Lock()
	s.policy.cur = a
	s.policy.mu.Unlock()
	return nil
}

func (s *Service) clearPolicy() bool {
	s.policy.mu.Lock()
	defer s.policy.mu.Unlock()
	had := s.policy.cur != nil
	s.policy.cur = nil
	return had
}

// Policy outcomes, the values of imagefleet_gc_policy_updates_total's result label.
const (
	policyApplied = "applied"
	policyRefused = "refused"
	policyRemoved = "removed"
)

func newPolicyUpdates(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	cv, err := promreg.RegisterOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "imagefleet", Subsystem: "gc",
		Name: "policy_updates_total", Help: "Delivered ImageGCPolicy values of the node, by result (applied, refused: invalid, the last good one kept; removed: the flags again)."},
		[]string{"result"}))
	if err != nil {
		return nil, err
	}
	for _, r := range []string{policyApplied, policyRefused, policyRemoved} {
		cv.WithLabelValues(r)
	}
	return cv, nil
}

// watchPolicy follows the node's key in events.GCPolicyBucket until ctx ends, without a consumer of the
// bucket (bus.FollowKey): a direct get of the key at the start, after each revision the controller announces
// on events.GCPolicyNotice, after a reconnection and every PolicyResync. FollowKey retries every read itself
// (a bucket not there yet, NATS away), the policy in force staying; it returns early only when it cannot
// subscribe at all (the connection closed). Nothing it meets ends the executor.
func (s *Service) watchPolicy(ctx context.Context) {
	err := s.bus.FollowKey(ctx, bus.KeyFollowerConfig{Bucket: events.GCPolicyBucket, Key: events.NodeToken(s.cfg.Node),
		Notices: events.GCPolicyNotice(s.cfg.Node), Resync: s.cfg.PolicyResync, Retry: s.cfg.PolicyRetry},
		func(e bus.Entry, found bool) {
			if !found {
				if s.clearPolicy() {
					s.policyRemoved()
				}
				return
			}
			if err := s.applyPolicy(e.Value, e.Revision); err != nil {
				s.policyUpdates.WithLabelValues(policyRefused).Inc()
				s.log.Error("image GC policy refused, the last good one stays in force", "revision", e.Revision, "err", err)
				return
			}
			s.policyUpdates.WithLabelValues(policyApplied).Inc()
			st := s.settings()
			s.log.Info("image GC policy applied from the next pass", "policy", policyNames(st.sources), "revision", e.Revision,
				"high_threshold", st.policy.HighThresholdPercent, "low_threshold", st.policy.LowThresholdPercent,
				"min_age", st.policy.MinAge, "max_age", st.policy.MaxAge, "capacity", st.capacity, "pinned_policies", len(st.pins))
		})
	if err != nil && ctx.Err() == nil {
		s.log.Error("image GC policy not followed, the node's flags and the policy in force stay", "err", err)
	}
}

func (s *Service) policyRemoved() {
	s.policyUpdates.WithLabelValues(policyRemoved).Inc()
	s.log.Info("image GC policy removed, the node's flags apply from the next pass")
}

func policyNames(src []events.GCPolicySource) string {
	return events.GCPolicy{Sources: src}.Names()
}

// keepPinnedByPolicies moves the candidates a policy pins to skipped.
func keepPinnedByPolicies(cands []candidate, skipped []events.GCSkipped, pins []policyPins) ([]candidate, []events.GCSkipped) {
	if len(pins) == 0 {
		return cands, skipped
	}
	kept := cands[:0]
next:
	for _, cd := range cands {
		for _, pp := range pins {
			if pp.m.match(cd.ImageRecord) {
				skipped = append(skipped, events.GCSkipped{ID: cd.ID, Why: WhyPinnedByGCPolicy, Policy: pp.policy})
				continue next
			}
		}
		kept = append(kept, cd)
	}
	return kept, skipped
}
