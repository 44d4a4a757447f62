package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

// A KeepNewNodes object's status while the keeper holds it: its counters and their writes.

// flusher writes each changed object's counters, at most every StatusInterval.
func (k *keeper) flusher(ctx context.Context) {
	t := time.NewTicker(k.cfg.StatusInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		k.mu.Lock()
		var todo []*keptObject
		for _, ko := range k.objs {
			if ko.dirty && ko.settled {
				todo = append(todo, ko)
			}
		}
		k.mu.Unlock()
		for _, ko := range todo {
			if err := k.flush(ctx, ko); err != nil && ctx.Err() == nil {
				k.log.Warn("status write failed; retrying", "name", ko.name, "err", err)
			}
		}
	}
}

// keptCounts are an object's counters with its joined nodes.
type keptCounts struct {
	Desired     int32                  `json:"desired"`
	Active      int32                  `json:"active"`
	Succeeded   int32                  `json:"succeeded"`
	Failed      int32                  `json:"failed"`
	Joined      int32                  `json:"joined"`
	Progress    string                 `json:"progress"`
	FailedNodes []v1alpha1.NodeFailure `json:"failedNodes,omitempty"`
}

// countsLocked sums ko's counters: the first rollout's, plus each joined node (desired and joined as it is
// taken on, succeeded or failed as it ends, active while it is at work). k.mu is held.
func (ko *keptObject) countsLocked() keptCounts {
	c := keptCounts{Succeeded: ko.baseOK, Failed: ko.baseFailed, Joined: int32(len(ko.joins)),
		FailedNodes: append([]v1alpha1.NodeFailure(nil), ko.failedNodes...)}
	for _, j := range ko.joins {
		switch {
		case !j.done:
			c.Active++
		case j.ok:
			c.Succeeded++
		default:
			c.Failed++
		}
	}
	c.Desired = int32(len(ko.planned)) + c.Joined
	c.Progress = fmt.Sprintf("%d/%d", c.Succeeded+c.Failed, c.Desired)
	return c
}

// flush writes ko's counters: a merge patch of the status, conditioned on the object's UID (the first
// rollout's runner has ended: it writes no more).
func (k *keeper) flush(ctx context.Context, ko *keptObject) error {
	k.mu.Lock()
	c := ko.countsLocked()
	ko.dirty = false
	k.mu.Unlock()
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"uid": ko.uid}, "status": c})
	if err == nil {
		obj := &v1alpha1.ImagePrePull{}
		obj.SetName(ko.name)
		err = k.status.Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch))
	}
	if err != nil {
		k.mu.Lock()
		ko.dirty = true
		k.mu.Unlock()
		return fmt.Errorf("patch status of %s: %w", ko.name, err)
	}
	return nil
}

func (k *keeper) event(obj client.Object, eventType, reason, note string, args ...any) {
	k.rec.Eventf(obj, nil, eventType, reason, reason, note, args...)
}
