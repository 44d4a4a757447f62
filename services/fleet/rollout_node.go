package fleet

import (
	"context"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// node runs the action on node i of the plan at most once per rollout. The error is for recording problems
// only; the node's own failure is in the result.
func (r *Rollout) node(ctx context.Context, st rolloutState, i int, node string, batch int) (events.RolloutNodeResult, error) {
	cfg := r.cfg
	if prev, ok := st.results[node]; ok {
		prev.Resumed = true
		return prev, nil
	}
	if c, ok := st.claims[node]; ok {
		return events.RolloutNodeResult{Node: node, Batch: batch, Resumed: true,
			Error: fmt.Sprintf("claimed by run %s at %s without a recorded outcome; not acted on again", c.Owner, c.Time.Format(time.RFC3339))}, nil
	}
	claimed, err := r.claimNode(ctx, i, node, batch)
	if err != nil {
		return events.RolloutNodeResult{}, fmt.Errorf("claim node %s: %w", node, err)
	}
	if !claimed {
		return events.RolloutNodeResult{Node: node, Batch: batch, Resumed: true,
			Error: "claimed by another run of this rollout; not acted on again"}, nil
	}
	if err := ctx.Err(); err != nil { // the run ended while the node waited for its range's claim
		return events.RolloutNodeResult{}, fmt.Errorf("claim node %s: %w", node, err)
	}
	began := cfg.Clock()
	actx, cancel := context.WithTimeout(ctx, cfg.NodeTimeout)
	nr := r.act(actx, node)
	if actx.Err() == context.DeadlineExceeded && !nr.OK && ctx.Err() == nil {
		nr.Error = fmt.Sprintf("no answer within the node timeout %v", cfg.NodeTimeout)
	}
	cancel()
	nr.Node, nr.Batch = node, batch
	nr.Duration = events.Duration{Duration: cfg.Clock().Sub(began)}
	if !nr.OK && nr.Error == "" {
		nr.Error = "failed without an error message"
	}
	// The node has been acted on: its outcome must be recorded, however long the cluster takes to elect a
	// leader. A real GC's record carries counts and bytes, not the lists of images (nr.Compact).
	rec := nr
	if cfg.Kind == events.RolloutGC && !cfg.DryRun {
		rec = nr.Compact()
	}
	if err := r.recordOutcome(ctx, rec); err != nil {
		return nr, fmt.Errorf("record outcome of node %s: %w", node, err)
	}
	return nr, nil
}

// claimNode reports whether this run's claim on node i is the first stored: the claim on its range, or on
// the node alone in a rollout of an earlier release (compat_node_records.go).
func (r *Rollout) claimNode(ctx context.Context, i int, node string, batch int) (bool, error) {
	if r.claims == nil {
		return r.claimNodeAlone(ctx, node, batch)
	}
	return r.claims.claim(ctx, i, batch)
}

// recordOutcome records a node's outcome: in a group, or in a record of its own in a rollout of an earlier
// release (compat_node_records.go).
func (r *Rollout) recordOutcome(ctx context.Context, rec events.RolloutNodeResult) error {
	if r.outcomes == nil {
		return r.recordNodeAlone(ctx, rec)
	}
	return r.outcomes.record(rec)
}

// recordRetryFor bounds the retries of a claim and of an outcome record: long enough for a cluster that
// lost a server to elect new leaders under load, and within the stream's 2-minute duplicate window, so a
// retried outcome is still stored once.
const recordRetryFor = 90 * time.Second

// transientRetryFor bounds the retries of the rollout's other writes and reads (the stream made, the start,
// batch and summary records, a node's pull request, the events stream's end): a transient bus error (a
// cluster server went away, a stream leader election) is retried with bus.Retry for up to 30 s, its waits
// growing to 1 s (bus.MaxWait). Every write retried is idempotent (Nats-Msg-Id). Each attempt gets its own
// context of at most bus.AttemptTimeout: a publish whose ack is lost with a killed server (the message
// stored, the ack routed through the dead server) would otherwise wait out the caller's whole deadline (a
// pre-pull's 90 s node timeout, CI's fleet test) instead of being sent again and answered as a duplicate.
const transientRetryFor = 30 * time.Second
