// Compatibility path: a claim and an outcome record per node.
//
// A rollout whose plan was recorded by an earlier release (events.RolloutStarted.ClaimSize 0), resumed by
// this release, keeps claiming and recording its nodes one record each, so that a run of the earlier
// release on the same rollout still sees every claim. loadRollout and FollowRollout read both forms.
//
// Remove when: rollouts started before claim ranges are past the rollout stream's 30-day MaxAge, and no
// earlier release's orchestrator can resume one (docs/upgrading.md, "Compatibility paths").

package fleet

import (
	"context"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// claimNodeAlone stores this run's claim on node unless one is stored, and reports whether the first claim
// stored is this run's.
func (r *Rollout) claimNodeAlone(ctx context.Context, node string, batch int) (bool, error) {
	cfg := r.cfg
	claim := events.RolloutClaim{Node: node, Owner: r.owner, Batch: batch, Time: cfg.Clock().UTC()}
	claimSubject := events.RolloutSubject(cfg.ID, events.RolloutClaimKind, node)
	var claimed bool
	err := bus.Retry(ctx, func(ctx context.Context) error {
		var err error
		claimed, err = r.publishFirst(ctx, claimSubject, "claim."+events.NodeToken(node)+"."+r.owner, claim)
		if err == nil && !claimed {
			// Refused because a claim is stored: it may be this run's own, from an attempt whose ack was
			// lost (a server killed, a leader change) and that the server did not answer as a duplicate.
			// The first claim stored is the one that counts (loadRollout), so ask the stream whose it is.
			if claimed, err = r.firstClaimIsOurs(ctx, claimSubject); claimed {
				cfg.Logger.Info("claim stored by an earlier attempt of this run", "rollout", cfg.ID, "node", node)
			}
		}
		return err
	}, bus.MaxElapsed(recordRetryFor), bus.MaxWait(time.Second))
	return claimed, err
}

// firstClaimIsOurs reports whether the first claim stored on subject is this run's.
func (r *Rollout) firstClaimIsOurs(ctx context.Context, subject string) (bool, error) {
	first, err := firstRecord[events.RolloutClaim](ctx, r.b, subject)
	if err != nil {
		return false, fmt.Errorf("read claim %s: %w", subject, err)
	}
	return first != nil && first.Owner == r.owner, nil
}

// recordNodeAlone records one node's outcome in a record of its own.
func (r *Rollout) recordNodeAlone(ctx context.Context, rec events.RolloutNodeResult) error {
	return bus.Retry(ctx, func(ctx context.Context) error {
		_, err := r.publish(ctx, events.RolloutSubject(r.cfg.ID, events.RolloutNodeKind, rec.Node), "node."+events.NodeToken(rec.Node), rec)
		return err
	}, bus.MaxElapsed(recordRetryFor), bus.MaxWait(time.Second))
}
