package fleet

import (
	"context"
	"errors"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// requester is the part of the bus a GC rollout needs.
type requester interface {
	Request(ctx context.Context, subject string, req any, resp any) error
}

// GCAction asks each node's GC executor (imagefleet.cmd.<node>.gc) to run req. A node whose executor
// answers with an error, or whose GC reports the kubelet's failure (GCResult.Error), has failed. A request
// nobody received (no responders: the node's agent is reconnecting, or not running) is sent again until the
// node timeout: it cannot have been acted on. When req.ID is set (fleet gc sets the rollout id), each node
// gets the id <req.ID>.<node> and an unanswered attempt is also sent again after gcAttemptTimeout: the
// executor answers a repeated id with the first pass's result, so a reply lost with a server costs one
// attempt, not the node timeout, and never a second pass.
func GCAction(b requester, req events.GCRequest) NodeAction {
	return func(ctx context.Context, node string) events.RolloutNodeResult {
		var res events.GCResult
		subject := events.CommandSubject(node, events.VerbGC)
		nreq := req
		if req.ID != "" {
			nreq.ID = NodeRequestID(req.ID, node)
		}
		for {
			actx, cancel := ctx, context.CancelFunc(func() {})
			if nreq.ID != "" {
				actx, cancel = context.WithTimeout(ctx, gcAttemptTimeout)
			}
			err := b.Request(actx, subject, nreq, &res)
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() == nil && (errors.Is(err, bus.ErrNoResponders) || (nreq.ID != "" && bus.IsTransient(err))) {
				select {
				case <-ctx.Done():
				case <-time.After(250 * time.Millisecond):
				}
				if ctx.Err() == nil {
					continue
				}
			}
			return events.RolloutNodeResult{Node: node, Error: err.Error()}
		}
		nr := events.RolloutNodeResult{Node: node, OK: res.Error == "", GC: &res}
		if res.Error != "" {
			nr.Error = res.Error
		}
		return nr
	}
}

// gcAttemptTimeout is how long GCAction waits for one answer before asking again with the same id (a pass
// that takes longer is answered to a later attempt, from the executor's memory of the id).
var gcAttemptTimeout = 15 * time.Second
