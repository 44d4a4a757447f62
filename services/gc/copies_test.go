package gc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

// TestKeepCopiesAsksTheFleetBeforeRemoving: under a delivered keepCopies, a pass asks the fleet (a responder
// on events.CopiesSubject over a real NATS) right before each removal batch and removes only what it grants;
// a dry run asks without recording; with nobody to ask, the pass keeps the batch.
func TestKeepCopiesAsksTheFleetBeforeRemoving(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 100), makeImage(2, 100))
	// No pass but the test's: the periodic loop and the usage check wait an hour.
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 90, LowThresholdPercent: 80}, CapacityBytes: 10000,
		PolicyRetry: 10 * time.Millisecond, Period: time.Hour, CheckPeriod: time.Hour}, rt, gctest.NewRecords(rt, nil), nil)
	bustest.RunService(t, s)
	kv, err := b.KV(ctx, PolicyBucketConfig())
	if err != nil {
		t.Fatal(err)
	}
	ip := func(v int) *int { return &v }
	quota := int64(300) // 100 % used: free down to 0 %, every image
	raw, _ := json.Marshal(events.GCPolicy{Sources: []events.GCPolicySource{{Name: "copies", Generation: 1}},
		HighThresholdPercent: ip(50), LowThresholdPercent: ip(0), CapacityBytes: &quota,
		KeepCopies: &events.GCKeepCopies{Count: 2, TopologyKey: "zone", Zone: "a", Policy: "copies"}})
	announcePolicy(t, b, kv, raw)
	bustest.Eventually(t, "the policy in force", 10*time.Second, func() error {
		if st := s.settings(); st.keepCopies == nil {
			return context.DeadlineExceeded
		}
		return nil
	})

	// The fleet allows image-1 only.
	var mu sync.Mutex
	var asked []events.CopiesRequest
	allowed := []string{imageID(1)}
	sctx, stop := context.WithCancel(ctx)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = b.Serve(sctx, events.CopiesSubject(testNode), events.CopiesQueue, func(_ context.Context, data []byte) (any, error) {
			var req events.CopiesRequest
			if err := json.Unmarshal(data, &req); err != nil {
				return nil, err
			}
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, req)
			if req.Release {
				return nil, nil
			}
			return events.CopiesReply{Allowed: slices.Clone(allowed)}, nil
		})
	}()
	keptWhy := func(res events.GCResult) map[string]string {
		out := map[string]string{}
		for _, sk := range res.Skipped {
			if sk.Policy == "copies" {
				out[sk.ID] = sk.Why
			}
		}
		return out
	}
	var res events.GCResult
	bustest.Eventually(t, "a dry run the fleet answered", 20*time.Second, func() error {
		// The pass fails (it cannot free down to 0 %): what it planned is the point.
		res, err = s.GarbageCollect(ctx, events.GCRequest{DryRun: true})
		if len(res.Removed) == 1 {
			return nil
		}
		return fmt.Errorf("err %v, result %+v", err, res)
	})
	if res.Removed[0].ID != imageID(1) || keptWhy(res)[imageID(0)] != "kept: one of the last 2 copies in zone zone=a (policy copies)" {
		t.Errorf("dry run: removed %+v, kept %v", res.Removed, keptWhy(res))
	}
	res, _ = s.GarbageCollect(ctx, events.GCRequest{})
	if len(res.Removed) != 1 || res.Removed[0].ID != imageID(1) || len(keptWhy(res)) != 2 {
		t.Errorf("pass: removed %+v, kept %v", res.Removed, keptWhy(res))
	}
	if imgs := rt.Images(); !slices.Equal(imgs, []string{imageID(0), imageID(2)}) {
		t.Errorf("images left %v", imgs)
	}
	mu.Lock()
	if len(asked) < 2 || !asked[0].DryRun || asked[len(asked)-1].DryRun || asked[0].Count != 2 || asked[0].Zone != "a" || asked[0].Node != testNode {
		t.Errorf("requests %+v", asked)
	}
	mu.Unlock()

	// A removal that fails gives its grant back; one whose outcome is unknown (a timeout: the runtime may
	// have removed the image all the same) keeps it.
	rt.FailRemove(imageID(0), errors.New("image is being used by a container"))
	rt.FailRemove(imageID(2), fmt.Errorf("remove image: %w", cri.ErrTimeout))
	mu.Lock()
	allowed, asked = []string{imageID(0), imageID(2)}, nil
	mu.Unlock()
	_, _ = s.GarbageCollect(ctx, events.GCRequest{})
	mu.Lock()
	var released [][]string
	for _, r := range asked {
		if r.Release {
			released = append(released, r.Images)
			if r.Node != testNode || r.DryRun {
				t.Errorf("release %+v", r)
			}
		}
	}
	if len(released) != 1 || !slices.Equal(released[0], []string{imageID(0)}) {
		t.Errorf("released %v, want image-0's grant only", released)
	}
	mu.Unlock()
	rt.FailRemove(imageID(0), nil)
	rt.FailRemove(imageID(2), nil)

	// Nobody to ask: the batch is kept.
	stop()
	<-served
	res, _ = s.GarbageCollect(ctx, events.GCRequest{})
	if len(res.Removed) != 0 || keptWhy(res)[imageID(0)] != "kept: keepCopies could not be checked (policy copies)" {
		t.Errorf("without the arbiter: removed %+v, kept %v", res.Removed, keptWhy(res))
	}
	if imgs := rt.Images(); len(imgs) != 2 {
		t.Errorf("images left %v", imgs)
	}
}
