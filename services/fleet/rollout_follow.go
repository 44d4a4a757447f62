package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// RolloutEvent is one record of a rollout's stream, as a follower sees it.
type RolloutEvent struct {
	// Kind is started, claim, batch, node or finished.
	Kind     string
	Seq      uint64
	Time     time.Time
	Started  *events.RolloutStarted
	Claim    *events.RolloutClaim
	Batch    *events.RolloutBatch
	Node     *events.RolloutNodeResult
	Finished *events.RolloutResult
}

// FollowRollout delivers rollout id's records from its start, then as they happen, until fn returns false
// or ctx ends. A follower sees exactly what the orchestrator recorded, so a second operator can watch.
// Making its reader may fail transiently for 20 s before the error is returned; ctx's deadline ending the
// follow returns ctx's error, its cancellation nil.
func FollowRollout(ctx context.Context, b *bus.Bus, id string, fn func(RolloutEvent) bool) error {
	prefix := events.Prefix + ".fleet.rollout." + id + "."
	err := b.Read(ctx, events.RolloutStream, events.RolloutFilter(id), func(m bus.StreamMsg) error {
		kind, _, _ := strings.Cut(strings.TrimPrefix(m.Subject, prefix), ".")
		ev := RolloutEvent{Kind: kind, Seq: m.Seq, Time: m.Time}
		var err error
		switch kind {
		case events.RolloutStartedKind:
			ev.Started = &events.RolloutStarted{}
			err = json.Unmarshal(m.Data, ev.Started)
		case events.RolloutClaimKind:
			ev.Claim = &events.RolloutClaim{}
			err = json.Unmarshal(m.Data, ev.Claim)
		case events.RolloutBatchKind:
			ev.Batch = &events.RolloutBatch{}
			err = json.Unmarshal(m.Data, ev.Batch)
		case events.RolloutNodeKind:
			ev.Node = &events.RolloutNodeResult{}
			err = json.Unmarshal(m.Data, ev.Node)
		case events.RolloutFinishedKind:
			ev.Finished = &events.RolloutResult{}
			err = json.Unmarshal(m.Data, ev.Finished)
		default:
			return nil
		}
		if err != nil {
			return nil // a damaged record is skipped, not fatal to the follower
		}
		if !fn(ev) {
			return bus.StopReading
		}
		return nil
	}, bus.Follow(), bus.RetryFor(followRetryFor))
	if err == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return ctx.Err()
	}
	return err
}

// followRetryFor bounds how long FollowRollout's reader may fail to be made before the follower hears of it.
const followRetryFor = 20 * time.Second
