package puller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
//
// A request that joins a runtime pull another request started returns nil as soon as it is recorded as
// riding on that request's message, and waits for the pull without a token of its own (riders.go says what
// becomes of it if the process dies). The message of a request that started a pull is acked only once the
// pull has ended and every request riding on it has its result. A redelivered message first runs the
// requests recorded as riding on it.
func (s *Service) HandlePull(ctx context.Context, data []byte, d Delivery) error {
	start := time.Now()
	req, err := DecodePullRequest(data)
	if err != nil {
		s.m.metrics.malformed.Inc()
		return bus.Permanent(err)
	}

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
					s.m.cfg.log.Warn("pull progress signal failed", "request_id", req.ID, "err", err)
				}
			}
		}
	}()
	defer func() { close(hbDone); <-hbStopped }()

	a := newAnchor(req.ID)
	var adopted []rider
	if d.Count > 1 && s.riders != nil {
		if adopted, err = s.adopt(ctx, a); err != nil {
			return err
		}
	}
	for _, r := range adopted {
		a.hold()
		s.rides.Add(1)
		go func() {
			defer s.rides.Done()
			defer a.release()
			err := recovered(func() error {
				_, err := s.handle(ctx, r.Request, r.Deliveries+1, time.Now(), a, false)
				return err
			})
			s.settle(ctx, a, r.Request.ID, err)
		}()
	}
	// A message that carries adopted requests keeps its token for the pulls they make.
	parked, err := s.handle(ctx, req, d.Count, start, a, s.riders != nil && len(adopted) == 0)
	if parked {
		return nil
	}
	a.release()
	select {
	case <-a.idle:
	case <-ctx.Done():
		select {
		case <-a.idle:
		default:
			// Stopping: hand the request back, with the requests riding on it still recorded.
			return ctx.Err()
		}
	}
	if ferr := s.failure(a); ferr != nil {
		// Redelivered, the message runs again the requests riding on it that have no result.
		return errors.Join(err, ferr)
	}
	s.clearRiders(ctx, a)
	return err
}

// handle runs req to its published result. own is the anchor of the message req came with or rides on: the
// runtime pull req starts holds it. With mayPark, a request that joins a pull of another message rides on
// that message instead: handle returns parked as soon as it is recorded there, and the request runs on to
// its result in the background. The error is the result's publishing's, or ctx's when the puller stops
// (then nothing is published).
func (s *Service) handle(ctx context.Context, req events.PullRequest, deliveries uint64, start time.Time, own *anchor, mayPark bool) (parked bool, err error) {
	var pod events.PodRef
	if req.Pod != nil {
		pod = *req.Pod
	}
	policy := req.Policy
	if policy == "" {
		policy = defaultPullPolicy(req.Image)
	}
	result := events.PullResult{RequestID: req.ID, Image: req.Image, Policy: policy, Pod: req.Pod, Deliveries: deliveries}
	if !req.Enqueued.IsZero() {
		result.QueueWait = events.Duration{Duration: max(start.Sub(req.Enqueued), 0)}
	}
	log := s.m.cfg.log.With("request_id", req.ID, "image_ref", req.Image, "pod_uid", pod.UID)

	if why := s.dropReason(req, pod); why != "" {
		s.m.metrics.cancelled.Inc()
		result.Error, result.Cancelled = events.ErrKindImagePull, true
		result.Message = fmt.Sprintf("pull of %q cancelled: %s", req.Image, why)
		return false, s.publishResult(ctx, req, result, KubeEvent{Severity: events.Warning, Reason: ReasonFailed,
			Message: fmt.Sprintf("Failed to pull image %q: %s", req.Image, why)}, start)
	}

	rctx, cancel := context.WithCancelCause(ctx)
	s.mu.Lock()
	s.inflight[req.ID] = &inflightReq{podUID: pod.UID, cancel: cancel}
	s.mu.Unlock()
	done := func() {
		cancel(nil)
		s.mu.Lock()
		delete(s.inflight, req.ID)
		s.mu.Unlock()
	}

	mreq := Request{Image: req.Image, Policy: req.Policy, Pod: pod, Secrets: req.Secrets, Annotations: req.Annotations, AllowPrivate: req.AllowPrivate,
		RuntimeHandler: req.RuntimeHandler, anchor: own}
	mreq.OnEvent = func(ev KubeEvent) {
		if ev.Reason != ReasonPulling {
			return
		}
		if err := s.publishEvent(rctx, events.ActionPulling, events.PullingEventID(req.ID), result, ev); err != nil {
			log.Warn("publish pulling event failed", "err", err)
		}
	}
	if !mayPark {
		defer done()
		return false, s.finish(ctx, req, result, s.m.EnsureImageExists(rctx, mreq), start, log)
	}

	joins := make(chan *anchor, 1) // the manager calls joined at most once
	mreq.joined = func(a *anchor) { joins <- a }
	detached := false
	defer func() {
		if detached {
			return
		}
		// A join the outcome came with holds the leader for nothing now.
		select {
		case leader := <-joins:
			leader.release()
		default:
		}
		done()
	}()
	// The outcome comes as a function so that a panic of EnsureImageExists is raised again where it is
	// received: in the handler, which the bus turns into a dead letter as before.
	outc := make(chan func() Outcome, 1)
	s.rides.Add(1)
	go func() {
		defer s.rides.Done()
		defer func() {
			if r := recover(); r != nil {
				outc <- func() Outcome { panic(r) }
			}
		}()
		out := s.m.EnsureImageExists(rctx, mreq)
		outc <- func() Outcome { return out }
	}()
	var out Outcome
	got := false
	select {
	case o := <-outc:
		out, got = o(), true
	case leader := <-joins:
		select {
		case o := <-outc: // the pull is already over
			leader.release()
			out, got = o(), true
		default:
			if own.sole() && s.park(ctx, leader, req, deliveries) {
				if ctx.Err() != nil {
					// Stopping while it was recorded: the leader's message may already be handed back
					// and read elsewhere, so this one is handed back too (the request may then run twice).
					_ = recovered(func() error { (<-outc)(); return nil })
					done()
					s.settle(ctx, leader, req.ID, ctx.Err())
					leader.release()
					return false, ctx.Err()
				}
				detached = true
				s.rides.Add(1)
				go func() {
					defer s.rides.Done()
					defer leader.release()
					err := recovered(func() error { return s.finish(ctx, req, result, (<-outc)(), start, log) })
					done()
					s.settle(ctx, leader, req.ID, err)
				}()
				return true, nil
			}
			leader.release()
		}
	}
	if !got {
		out = (<-outc)()
	}
	return false, s.finish(ctx, req, result, out, start, log)
}

// finish publishes the result of req's outcome. While the puller stops it publishes nothing and returns
// ctx's error: the request is handed back rather than reported as a cancellation nobody asked for.
func (s *Service) finish(ctx context.Context, req events.PullRequest, result events.PullResult, out Outcome, start time.Time, log *slog.Logger) error {
	if ctx.Err() != nil {
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

// recovered runs f, turning a panic into an error: for the requests that run outside the bus's handler,
// which would otherwise take the process down.
func recovered(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("handler panic: %v", r)
		}
	}()
	return f()
}
