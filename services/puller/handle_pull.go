package puller

import (
	"context"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Delivery is what the work queue says about one delivery of a request.
type Delivery struct {
	// Count is the delivery number (1 the first time; more after a puller died or handed it back).
	Count uint64
	// InProgress resets the server's ack timer (nil: nothing to tell).
	InProgress func() error
}

// DecodePullRequest decodes and validates a pull request body. Errors wrap events.ErrMalformed: the request
// can never be processed.
func DecodePullRequest(data []byte) (events.PullRequest, error) {
	var req events.PullRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return events.PullRequest{}, fmt.Errorf("decode pull request: %w", err)
	}
	return req, nil
}

// HandlePull handles one pull request: EnsureImageExists, then the pull.pulling event (when a pull starts)
// and the terminal pull.pulled or pull.failed event, whose id derives from the request id. It returns nil
// when the request is done (acked), a bus.Permanent error for a malformed request (dead letter), and any
// other error to have it redelivered (the result could not be published, or the puller is stopping).
func (s *Service) HandlePull(ctx context.Context, data []byte, d Delivery) error {
	start := time.Now()
	req, err := DecodePullRequest(data)
	if err != nil {
		s.m.metrics.malformed.Inc()
		return bus.Permanent(err)
	}
	var pod events.PodRef
	if req.Pod != nil {
		pod = *req.Pod
	}
	policy := req.Policy
	if policy == "" {
		policy = defaultPullPolicy(req.Image)
	}
	result := events.PullResult{RequestID: req.ID, Image: req.Image, Policy: policy, Pod: req.Pod, Deliveries: d.Count}
	if !req.Enqueued.IsZero() {
		result.QueueWait = events.Duration{Duration: max(start.Sub(req.Enqueued), 0)}
	}
	log := s.m.cfg.log.With("request_id", req.ID, "image_ref", req.Image, "pod_uid", pod.UID)

	if why := s.dropReason(req, pod); why != "" {
		s.m.metrics.cancelled.Inc()
		result.Error, result.Cancelled = events.ErrKindImagePull, true
		result.Message = fmt.Sprintf("pull of %q cancelled: %s", req.Image, why)
		return s.publishResult(ctx, req, result, KubeEvent{Severity: events.Warning, Reason: ReasonFailed,
			Message: fmt.Sprintf("Failed to pull image %q: %s", req.Image, why)}, start)
	}

	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s.mu.Lock()
	s.inflight[req.ID] = &inflightReq{podUID: pod.UID, cancel: cancel}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.inflight, req.ID)
		s.mu.Unlock()
	}()

	// Tell the server the request is alive while it runs, so only a dead puller's requests are redelivered.
	hbDone := make(chan struct{})
	hbStopped := make(chan struct{})
	go func() {
		defer close(hbStopped)
		if d.InProgress == nil {
			return
		}
		t := time.NewTicker(max(s.cfg.AckWait/3, 10*time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-hbDone:
				return
			case <-t.C:
				if err := d.InProgress(); err != nil {
					log.Warn("pull progress signal failed", "err", err)
				}
			}
		}
	}()
	defer func() { close(hbDone); <-hbStopped }()

	mreq := Request{Image: req.Image, Policy: req.Policy, Pod: pod, Secrets: req.Secrets, Annotations: req.Annotations, AllowPrivate: req.AllowPrivate,
		RuntimeHandler: req.RuntimeHandler}
	mreq.OnEvent = func(ev KubeEvent) {
		if ev.Reason != ReasonPulling {
			return
		}
		if err := s.publishEvent(rctx, events.ActionPulling, events.PullingEventID(req.ID), result, ev); err != nil {
			log.Warn("publish pulling event failed", "err", err)
		}
	}
	out := s.m.EnsureImageExists(rctx, mreq)
	if ctx.Err() != nil {
		// Stopping: hand the request back rather than report a cancellation nobody asked for.
		return ctx.Err()
	}
	result.ImageRef, result.ImageSize, result.Pulled, result.Shared = out.ImageRef, out.ImageSize, out.Pulled, out.Shared
	result.Error, result.Message, result.Cancelled = out.Kind(), out.Message, out.Cancelled
	result.PullDuration = events.Duration{Duration: out.PullDuration}
	if out.Cancelled {
		s.m.metrics.cancelled.Inc()
	}
	var last KubeEvent
	if n := len(out.Events); n > 0 {
		last = out.Events[n-1]
	}
	if err := s.publishResult(ctx, req, result, last, start); err != nil {
		return err
	}
	if out.Err != nil {
		log.Info("pull failed", "error_kind", result.Error, "message", result.Message)
	}
	return nil
}

func (s *Service) publishResult(ctx context.Context, req events.PullRequest, result events.PullResult, ev KubeEvent, start time.Time) error {
	action := events.ActionPulled
	if result.Error != "" {
		action = events.ActionFailed
	}
	result.Duration = events.Duration{Duration: time.Since(start)}
	result.Finished = time.Now().UTC()
	// The result must reach the stream even if the request's own context ended (a cancelled pull).
	if err := s.publishEvent(context.WithoutCancel(ctx), action, events.PullResultEventID(req.ID), result, ev); err != nil {
		return fmt.Errorf("publish pull result of %s: %w", req.ID, err)
	}
	return nil
}

func (s *Service) publishEvent(ctx context.Context, action, id string, data events.PullResult, kev KubeEvent) error {
	ev, err := events.New(s.cfg.Node, events.EntityPull, action, data)
	if err != nil {
		return err
	}
	ev.ID = id
	var obj *events.ObjectRef
	if data.Pod != nil {
		obj = &events.ObjectRef{Kind: "Pod", Namespace: data.Pod.Namespace, Name: data.Pod.Name, UID: data.Pod.UID,
			FieldPath: data.Pod.FieldPath}
	}
	if kev.Reason != "" {
		ev = ev.WithKube(kev.Severity, kev.Reason, kev.Message, obj)
	} else {
		ev.Object = obj
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return s.bus.Publish(ctx, ev)
}
