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
	// Kind is started, claim, batch, node or finished: a record claiming a range of nodes is a claim event
	// per node, a group of outcomes a node event per node (with the record's Seq and Time).
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
		for _, ev := range rolloutEvents(kind, m) {
			if !fn(ev) {
				return bus.StopReading
			}
		}
		return nil
	}, bus.Follow(), bus.RetryFor(followRetryFor))
	if err == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return ctx.Err()
	}
	return err
}

// rolloutEvents decodes one record of the rollout stream: a claim on a range and a group of outcomes are an
// event per node, as a record per node is. A damaged record is skipped (nil), not fatal to the follower.
func rolloutEvents(kind string, m bus.StreamMsg) []RolloutEvent {
	ev := RolloutEvent{Kind: kind, Seq: m.Seq, Time: m.Time}
	var err error
	switch kind {
	case events.RolloutStartedKind:
		ev.Started = &events.RolloutStarted{}
		err = json.Unmarshal(m.Data, ev.Started)
	case events.RolloutClaimKind:
		ev.Claim = &events.RolloutClaim{}
		err = json.Unmarshal(m.Data, ev.Claim)
	case events.RolloutClaimsKind:
		var c events.RolloutClaims
		if json.Unmarshal(m.Data, &c) != nil {
			return nil
		}
		out := make([]RolloutEvent, 0, len(c.Nodes))
		for _, claim := range c.Claims() {
			out = append(out, RolloutEvent{Kind: events.RolloutClaimKind, Seq: m.Seq, Time: m.Time, Claim: &claim})
		}
		return out
	case events.RolloutBatchKind:
		ev.Batch = &events.RolloutBatch{}
		err = json.Unmarshal(m.Data, ev.Batch)
	case events.RolloutNodeKind:
		ev.Node = &events.RolloutNodeResult{}
		err = json.Unmarshal(m.Data, ev.Node)
	case events.RolloutNodesKind:
		var g events.RolloutNodes
		if json.Unmarshal(m.Data, &g) != nil {
			return nil
		}
		out := make([]RolloutEvent, 0, len(g.Nodes))
		for _, nr := range g.Nodes {
			out = append(out, RolloutEvent{Kind: events.RolloutNodeKind, Seq: m.Seq, Time: m.Time, Node: &nr})
		}
		return out
	case events.RolloutFinishedKind:
		ev.Finished = &events.RolloutResult{}
		err = json.Unmarshal(m.Data, ev.Finished)
	default:
		return nil
	}
	if err != nil {
		return nil
	}
	return []RolloutEvent{ev}
}

// followRetryFor bounds how long FollowRollout's reader may fail to be made before the follower hears of it.
const followRetryFor = 20 * time.Second
