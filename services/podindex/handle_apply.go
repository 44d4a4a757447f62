package podindex

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// applyTimeout bounds how long one podapply request waits for the index (a previous request's events, then
// its own with Wait); the client's own timeout is usually shorter.
const applyTimeout = time.Minute

// applier serializes the podapply requests of one index: each resolves its pods against a state that holds
// every earlier request's events, so two concurrent applies of one new pod give one added and one updated.
type applier struct {
	mu sync.Mutex
	// fence is the stream sequence of the last event a request stored: the next request waits until the
	// index applied it before it resolves its pods.
	fence uint64
}

// appliedWaiters wakes the goroutines waiting for the applied sequence to reach some value.
type appliedWaiters struct {
	waiting atomic.Int32 // the tail signals only when someone waits
	mu      sync.Mutex
	ch      chan struct{} // closed and replaced each time the applied sequence moves while someone waits
}

// advanced is called by the tail after the applied sequence moved.
func (w *appliedWaiters) advanced() {
	if w.waiting.Load() == 0 {
		return
	}
	w.mu.Lock()
	if w.ch != nil {
		close(w.ch)
		w.ch = nil
	}
	w.mu.Unlock()
}

// wait blocks until applied() >= seq or ctx ends.
func (w *appliedWaiters) wait(ctx context.Context, seq uint64, applied func() uint64) error {
	w.waiting.Add(1)
	defer w.waiting.Add(-1)
	for {
		w.mu.Lock()
		if w.ch == nil {
			w.ch = make(chan struct{})
		}
		ch := w.ch
		w.mu.Unlock()
		if applied() >= seq {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// waitApplied blocks until the index applied stream sequence seq, or ctx ends.
func (s *Service) waitApplied(ctx context.Context, seq uint64) error {
	if err := s.seqWaiters.wait(ctx, seq, s.state.Applied); err != nil {
		return fmt.Errorf("wait for the pod index of %s to apply sequence %d (applied %d): %w", s.cfg.Node, seq,
			s.state.Applied(), err)
	}
	return nil
}

// handleApply answers imagefleet.cmd.<node>.podapply (events.PodApplyRequest -> events.PodApplyReply): it
// checks every pod first (one refused pod refuses the request, and nothing is stored), then, one request at a
// time, decides each pod's action and UID against the index, stores the pod events and, with Wait, answers
// once it applied them.
func (s *Service) handleApply(ctx context.Context, data []byte) (any, error) {
	var req events.PodApplyRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	pods := make([]*v1.Pod, len(req.Pods))
	for i, raw := range req.Pods {
		p, err := DecodePod(raw)
		if err != nil {
			return nil, fmt.Errorf("pod %d of the request: %w", i+1, err)
		}
		if req.Op == events.PodApply {
			if err := ValidatePod(p); err != nil {
				return nil, err
			}
		}
		pods[i] = p
	}
	if err := s.errCatchingUp(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, applyTimeout)
	defer cancel()
	s.apply.mu.Lock()
	defer s.apply.mu.Unlock()
	if err := s.waitApplied(ctx, s.apply.fence); err != nil {
		return nil, err
	}
	results, msgs, err := s.resolve(req, pods, time.Now())
	if err != nil {
		return nil, err
	}
	last, err := s.pods.PublishMsgs(ctx, msgs)
	if last > s.apply.fence {
		s.apply.fence = last
	}
	if err != nil {
		return nil, fmt.Errorf("store pod events: %w", err)
	}
	rep := events.PodApplyReply{Results: results, Seq: last}
	if req.Wait {
		if err := s.waitApplied(ctx, last); err != nil {
			return nil, err
		}
	}
	rep.AppliedSeq = s.state.Applied()
	return rep, nil
}

// resolve decides each pod's event against the index, and against the request's earlier pods: a mirror pod
// manifest is matched with the indexed mirror pod of its name, any other with the indexed pod, so a UID is
// never carried from one kind to the other. Deleting by name falls back to the mirror pod when there is no
// pod of that name.
func (s *Service) resolve(req events.PodApplyRequest, pods []*v1.Pod, now time.Time) ([]events.PodApplyResult, []bus.RawMsg, error) {
	type key struct {
		fullName string
		mirror   bool
	}
	overlay := map[key]*v1.Pod{} // the request's earlier pods (nil: deleted)
	lookup := func(p *v1.Pod, mirror bool) *v1.Pod {
		if o, ok := overlay[key{PodFullName(p), mirror}]; ok {
			return o
		}
		var found *v1.Pod
		if mirror {
			found, _ = s.state.Index.getMirrorPodByPod(p)
		} else {
			found, _ = s.state.Index.GetPodByFullName(PodFullName(p))
		}
		return found
	}
	results := make([]events.PodApplyResult, 0, len(pods))
	msgs := make([]bus.RawMsg, 0, len(pods))
	for _, p := range pods {
		fn := PodFullName(p)
		mirror := IsMirrorPod(p)
		existing := lookup(p, mirror)
		if req.ByName && !mirror && existing == nil {
			mirror = true
			existing = lookup(p, true)
		}
		var act string
		switch {
		case req.Op == events.PodDelete:
			act = events.ActionDeleted
			if existing == nil {
				if p.UID == "" {
					return nil, nil, fmt.Errorf("pod %s/%s is not in the index of %s and has no uid to delete", p.Namespace, p.Name, s.cfg.Node)
				}
			} else if p.UID == "" || p.UID == existing.UID {
				p = existing
				overlay[key{fn, mirror}] = nil
			}
		default:
			// The index holds this pod when it holds one of its name and kind and the manifest names no
			// other UID: the pod keeps that UID.
			held := existing != nil && (p.UID == "" || p.UID == existing.UID)
			switch {
			case held:
				p.UID = existing.UID
			case p.UID == "":
				p.UID = types.UID(uuid.NewString())
			}
			act = events.UpsertAction(held)
			overlay[key{fn, mirror}] = p
		}
		m, err := PodEventMsg(s.cfg.Node, act, p, "", now)
		if err != nil {
			return nil, nil, err
		}
		msgs = append(msgs, m)
		results = append(results, events.PodApplyResult{Action: act, Namespace: p.Namespace, Name: p.Name,
			UID: string(p.UID), Mirror: mirror})
	}
	return results, msgs, nil
}
