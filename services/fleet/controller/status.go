package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// markLocked notes that the status changed; now asks for it to be written at once rather than at the next
// StatusInterval (a wave's start, a failure listed, a pause). run.mu is held.
func (run *runner) markLocked(now bool) {
	run.dirty = true
	if now {
		select {
		case run.flushNow <- struct{}{}:
		default:
		}
	}
}

// flusher writes the status when it changed: at once when asked, else at most every StatusInterval. It
// ends with the runner's context.
func (run *runner) flusher() {
	t := time.NewTicker(run.r.cfg.StatusInterval)
	defer t.Stop()
	for {
		select {
		case <-run.ctx.Done():
			return
		case <-t.C:
		case <-run.flushNow:
		}
		if err := run.flush(run.ctx); err != nil && run.ctx.Err() == nil {
			run.r.log.Warn("status write failed; retrying", "name", run.name, "err", err)
		}
	}
}

// flushSync writes the status now, retrying until it is written or the runner stops (an error then).
func (run *runner) flushSync() error {
	wait := 100 * time.Millisecond
	for {
		err := run.flush(run.ctx)
		if err == nil {
			return nil
		}
		run.r.log.Warn("status write failed; retrying", "name", run.name, "err", err, "after", wait)
		select {
		case <-time.After(wait):
		case <-run.ctx.Done():
			return run.ctx.Err()
		}
		wait = min(2*wait, 10*time.Second)
	}
}

// flush writes the status if it changed since the last write: one merge patch of the status subresource,
// conditioned on the object's UID (an object made anew under the same name is not written). The flusher and
// flushSync write one at a time, each a copy taken under flushMu: two patches in flight at once could land
// in the wrong order, the older status last (an object left Running after its final Complete was written).
func (run *runner) flush(ctx context.Context) error {
	run.flushMu.Lock()
	defer run.flushMu.Unlock()
	run.mu.Lock()
	if !run.dirty {
		run.mu.Unlock()
		return nil
	}
	st := run.status.DeepCopy()
	run.dirty = false
	run.mu.Unlock()
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"uid": run.uid},
		"status":   st,
	})
	if err != nil {
		return err
	}
	obj := run.r.kind.newObject()
	obj.SetName(run.name)
	err = run.r.status.Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch))
	if err != nil {
		run.mu.Lock()
		run.dirty = true
		run.mu.Unlock()
		return fmt.Errorf("patch status of %s: %w", run.name, err)
	}
	run.r.m.statusWrites.WithLabelValues(run.r.kind.name).Inc()
	return nil
}
