package gc

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

// TestRunningExecutorFollowsItsImageGCPolicy delivers ImageGCPolicy values to a running executor through a
// real NATS key-value bucket (made after the executor started, as when bus init runs late), each write
// announced as the controller announces it, and checks that each pass applies the value in force then:
// thresholds, byte quota and pinned images over the flags; an invalid value is refused and the last good
// one kept; a deleted key restores the flags. The executor's own resync is an hour away, so every change
// arrives by its notice.
func TestRunningExecutorFollowsItsImageGCPolicy(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 100), makeImage(2, 100), makeImage(3, 100))
	// The flags: a 10000-byte quota (4 % used), thresholds 90/80, no minimum age.
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, CapacityBytes: 10000,
		PolicyRetry: 10 * time.Millisecond, PolicyResync: time.Hour}, rt, gctest.NewRecords(rt, nil), nil)
	bustest.RunService(t, s)
	ctx := t.Context()

	dry := func() events.GCResult {
		t.Helper()
		res, err := s.GarbageCollect(ctx, events.GCRequest{DryRun: true})
		if err != nil {
			t.Fatalf("dry run: %v", err)
		}
		return res
	}
	removed := func(res events.GCResult) []string {
		var ids []string
		for _, r := range res.Removed {
			ids = append(ids, r.ID)
		}
		slices.Sort(ids)
		return ids
	}
	pinnedBy := func(res events.GCResult) map[string]string {
		out := map[string]string{}
		for _, sk := range res.Skipped {
			if sk.Why == WhyPinnedByGCPolicy {
				out[sk.ID] = sk.Policy
			}
		}
		return out
	}
	waitPolicy := func(want string) events.GCResult {
		t.Helper()
		var res events.GCResult
		bustest.Eventually(t, "policy "+want+" in force", 10*time.Second, func() error {
			res = dry()
			if got := policyNames(res.Policies); got != want {
				return fmt.Errorf("pass applied policy %q", got)
			}
			return nil
		})
		return res
	}

	if res := dry(); len(res.Policies) != 0 || res.CapacityBytes != 10000 || len(res.Removed) != 0 {
		t.Fatalf("before any policy: %+v", res)
	}

	kv, err := b.KV(ctx, PolicyBucketConfig())
	if err != nil {
		t.Fatal(err)
	}
	put := func(p events.GCPolicy) {
		t.Helper()
		raw, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		announcePolicy(t, b, kv, raw)
	}
	ip := func(v int) *int { return &v }
	quota := int64(500)

	// A 500-byte quota (80 % used), 50/30: free down to 150 bytes; image-0 pinned by the policy.
	put(events.GCPolicy{Sources: []events.GCPolicySource{{Name: "p1", Generation: 1}},
		HighThresholdPercent: ip(50), LowThresholdPercent: ip(30), CapacityBytes: &quota,
		Pinned: []events.GCPolicyPins{{Policy: "p1", Images: []string{imageName(0)}}}})
	res := waitPolicy("p1/1")
	if res.CapacityBytes != 500 || res.UsagePercent != 80 || !slices.Equal(removed(res), []string{imageID(1), imageID(2), imageID(3)}) ||
		pinnedBy(res)[imageID(0)] != "p1" {
		t.Errorf("p1/1 plan: removed %v, pinned %v, result %+v", removed(res), pinnedBy(res), res)
	}

	// An invalid value (low above high once merged) is refused: p1/1 stays.
	put(events.GCPolicy{Sources: []events.GCPolicySource{{Name: "p1", Generation: 2}}, LowThresholdPercent: ip(95)})
	bustest.Eventually(t, "the invalid policy refused", 10*time.Second, func() error {
		if n := testutil.ToFloat64(s.policyUpdates.WithLabelValues(policyRefused)); n != 1 {
			return fmt.Errorf("%v refused", n)
		}
		return nil
	})
	if res := dry(); policyNames(res.Policies) != "p1/1" || len(res.Removed) != 3 {
		t.Errorf("after the refused value: policy %q, removed %v", policyNames(res.Policies), removed(res))
	}

	// Edited: low 25, image-1 pinned instead. A real pass applies it.
	put(events.GCPolicy{Sources: []events.GCPolicySource{{Name: "p1", Generation: 3}},
		HighThresholdPercent: ip(50), LowThresholdPercent: ip(25), CapacityBytes: &quota,
		Pinned: []events.GCPolicyPins{{Policy: "p1", Images: []string{"image-1-*"}}}})
	waitPolicy("p1/3")
	res, err = s.GarbageCollect(ctx, events.GCRequest{})
	if err != nil {
		t.Fatalf("pass under p1/3: %v", err)
	}
	if !slices.Equal(removed(res), []string{imageID(0), imageID(2), imageID(3)}) || pinnedBy(res)[imageID(1)] != "p1" || policyNames(res.Policies) != "p1/3" {
		t.Errorf("p1/3 pass: removed %v, pinned %v", removed(res), pinnedBy(res))
	}
	if imgs, _ := rt.ListImages(ctx); len(imgs) != 1 || imgs[0].ID != imageID(1) {
		t.Errorf("images left: %+v", imgs)
	}

	// Deleted: the flags again (10000-byte quota, nothing to free).
	announcePolicy(t, b, kv, nil)
	res = waitPolicy("")
	if res.CapacityBytes != 10000 || len(res.Removed) != 0 {
		t.Errorf("after delete: %+v", res)
	}
	if n := testutil.ToFloat64(s.policyUpdates.WithLabelValues(policyRemoved)); n != 1 {
		t.Errorf("removed counted %v times", n)
	}
}

// TestExecutorReadsItsImageGCPolicyWithoutANotice writes the node's key without announcing it (a notice lost
// with a connection, or a writer that died after its write) and checks that the executor's periodic read
// applies it, and then a deletion, all the same.
func TestExecutorReadsItsImageGCPolicyWithoutANotice(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100))
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, CapacityBytes: 10000,
		PolicyRetry: 10 * time.Millisecond, PolicyResync: 100 * time.Millisecond}, rt, gctest.NewRecords(rt, nil), nil)
	bustest.RunService(t, s)
	ctx := t.Context()
	kv, err := b.KV(ctx, PolicyBucketConfig())
	if err != nil {
		t.Fatal(err)
	}
	key := events.NodeToken(testNode)
	quota := int64(500)
	raw, err := json.Marshal(events.GCPolicy{Sources: []events.GCPolicySource{{Name: "p1", Generation: 1}}, CapacityBytes: &quota})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, raw); err != nil {
		t.Fatal(err)
	}
	applied := func(want string, capacity int64) func() error {
		return func() error {
			res, err := s.GarbageCollect(ctx, events.GCRequest{DryRun: true})
			if err != nil {
				return err
			}
			if got := policyNames(res.Policies); got != want || res.CapacityBytes != capacity {
				return fmt.Errorf("pass applied policy %q, capacity %d", got, res.CapacityBytes)
			}
			return nil
		}
	}
	bustest.Eventually(t, "p1/1 read without a notice", 10*time.Second, applied("p1/1", 500))
	if err := kv.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "the deletion read without a notice", 10*time.Second, applied("", 10000))
}

func TestMergePolicyChecksAsTheFlags(t *testing.T) {
	cfg := Config{Node: testNode, Policy: DefaultPolicy(), PinnedImages: []string{"busybox"}}
	ip := func(v int) *int { return &v }
	q := int64(0)
	for _, tc := range []struct {
		name string
		p    events.GCPolicy
		want string
	}{
		{"high only, above the flags' low", events.GCPolicy{HighThresholdPercent: ip(90)}, ""},
		{"high at the flags' low", events.GCPolicy{HighThresholdPercent: ip(80)}, "must be less than imageGCHighThresholdPercent"},
		{"max age not above the flags' min age", events.GCPolicy{MaxAge: &events.Duration{Duration: time.Minute}}, "imageMaximumGCAge 1m0s must be greater than imageMinimumGCAge 2m0s"},
		{"zero quota", events.GCPolicy{CapacityBytes: &q}, "capacityBytes 0 must be positive"},
		{"bad pinned reference", events.GCPolicy{Pinned: []events.GCPolicyPins{{Policy: "p", Images: []string{"UPPER/Case"}}}}, "is neither a reference nor an image ID"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := mergePolicy(cfg, tc.p)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("err = %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("err = %v, want %q", err, tc.want)
			case tc.want == "" && (got.Policy.HighThresholdPercent != 90 || !slices.Equal(got.PinnedImages, []string{"busybox"})):
				t.Fatalf("merged %+v", got)
			}
		})
	}
}

// announcePolicy writes testNode's policy key (raw, or a deletion when nil) and announces its revision, as
// the controller does: the executor under test reads its key on the notice.
func announcePolicy(t *testing.T, b *bus.Bus, kv *bus.KV, raw []byte) {
	t.Helper()
	key := events.NodeToken(testNode)
	puts, deletes := map[string][]byte{key: raw}, []string(nil)
	if raw == nil {
		puts, deletes = nil, []string{key}
	}
	revs, err := kv.BatchRevisions(t.Context(), puts, deletes)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AnnounceRevision(events.GCPolicyNotice(testNode), revs[key]); err != nil {
		t.Fatal(err)
	}
}
