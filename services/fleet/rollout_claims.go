package fleet

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// claimSize caps the RolloutStarted.ClaimSize of the plans this release records: a claim record covers at
// most 64 nodes of one batch, and at most the in-flight cap the rollout started with (MaxInFlight 1 claims
// node by node). The size is the plan's: a resumed run with another cap keeps it, as every run must cut the
// same ranges.
// The nodes take their places in plan order, so at any time only the range claimed last may hold nodes not
// started yet: a run that dies leaves fewer than ClaimSize claimed nodes it never acted on (they count
// failed on a resume: at most once, never twice). A 10,000-node rollout writes about 160 claims instead of
// 10,000.
const claimSize = 64

// claimRanges cuts a plan's batches into the claim ranges of RolloutStarted.ClaimSize: every run of a
// rollout cuts them alike (the plan's node count, initial batch and claim size are recorded), so the first
// claim stored on a range's subject decides, for all its nodes, which run acts.
type claimRanges struct {
	starts []int // each batch's first index, and the plan's length last
	size   int
}

func newClaimRanges(count, initialBatch, size int) claimRanges {
	cr := claimRanges{size: size}
	next := 0
	for _, b := range PlanBatches(count, initialBatch) {
		cr.starts = append(cr.starts, next)
		next += b
	}
	cr.starts = append(cr.starts, next)
	return cr
}

// of returns the range [first, end) that holds node index i.
func (cr claimRanges) of(i int) (first, end int) {
	for b := 0; b+1 < len(cr.starts); b++ {
		start, stop := cr.starts[b], cr.starts[b+1]
		if i < stop {
			first = start + (i-start)/cr.size*cr.size
			return first, min(first+cr.size, stop)
		}
	}
	return i, i + 1 // not in the plan: a range of its own
}

// rangeClaimer claims the plan's nodes a range at a time: the first node of a range to start writes the
// range's claim, the others wait for it.
type rangeClaimer struct {
	r      *Rollout
	nodes  []string
	ranges claimRanges
	mu     sync.Mutex
	claims map[int]*rangeClaim // by the range's first index
}

// rangeClaim is one range's claim: done closes once ours and err are known.
type rangeClaim struct {
	done chan struct{}
	ours bool
	err  error
}

func newRangeClaimer(r *Rollout, plan events.RolloutStarted) *rangeClaimer {
	return &rangeClaimer{r: r, nodes: plan.Nodes, ranges: newClaimRanges(len(plan.Nodes), plan.InitialBatch, plan.ClaimSize),
		claims: map[int]*rangeClaim{}}
}

// claim reports whether this run's claim on the range holding node i is the first stored (and so this run
// acts on node i); the error is the claim's write failing.
func (c *rangeClaimer) claim(ctx context.Context, i, batch int) (bool, error) {
	first, end := c.ranges.of(i)
	c.mu.Lock()
	rc, started := c.claims[first]
	if !started {
		rc = &rangeClaim{done: make(chan struct{})}
		c.claims[first] = rc
	}
	c.mu.Unlock()
	if !started {
		rc.ours, rc.err = c.r.claimRange(ctx, first, c.nodes[first:end], batch)
		close(rc.done)
	}
	select {
	case <-rc.done:
	case <-ctx.Done():
	}
	if err := ctx.Err(); err != nil { // a run that ended acts on no node, whoever claimed its range
		return false, err
	}
	return rc.ours, rc.err
}

// claimRange stores this run's claim on the nodes of the range that starts at first, unless a claim is
// stored there already, and reports whether the first claim stored is this run's.
func (r *Rollout) claimRange(ctx context.Context, first int, nodes []string, batch int) (bool, error) {
	cfg := r.cfg
	claim := events.RolloutClaims{First: first, Nodes: nodes, Owner: r.owner, Batch: batch, Time: cfg.Clock().UTC()}
	subject := events.RolloutClaimsSubject(cfg.ID, first)
	var claimed bool
	err := bus.Retry(ctx, func(ctx context.Context) error {
		var err error
		claimed, err = r.publishFirst(ctx, subject, "claims."+strconv.Itoa(first)+"."+r.owner, claim)
		if err == nil && !claimed {
			// Refused because a claim is stored: it may be this run's own, from an attempt whose ack was
			// lost (a server killed, a leader change) and that the server did not answer as a duplicate.
			// The first claim stored is the one that counts (loadRollout), so ask the stream whose it is.
			var ours *events.RolloutClaims
			if ours, err = firstRecord[events.RolloutClaims](ctx, r.b, subject); err != nil {
				err = fmt.Errorf("read claim %s: %w", subject, err)
			} else if claimed = ours != nil && ours.Owner == r.owner; claimed {
				cfg.Logger.Info("claim stored by an earlier attempt of this run", "rollout", cfg.ID, "first", first, "nodes", len(nodes))
			}
		}
		return err
	}, bus.MaxElapsed(recordRetryFor), bus.MaxWait(time.Second))
	if err != nil {
		return false, fmt.Errorf("nodes %d-%d: %w", first, first+len(nodes)-1, err)
	}
	return claimed, nil
}
