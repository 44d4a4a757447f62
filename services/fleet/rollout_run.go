package fleet

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Run runs the rollout and returns its result. A failed node is in the result, not an error; the error is
// for the rollout itself (the stream cannot be written, ctx ended).
func (r *Rollout) Run(ctx context.Context) (events.RolloutResult, error) {
	cfg := r.cfg
	began := cfg.Clock()
	res := events.RolloutResult{ID: cfg.ID, Kind: cfg.Kind, DryRun: cfg.DryRun, Started: began.UTC(),
		Failed: []events.RolloutNodeError{}, Nodes: []events.RolloutNodeResult{}, Batches: []int{}}
	st, plan, err := r.begin(ctx, &cfg, began)
	if err != nil {
		return res, err
	}
	res.DryRun = plan.DryRun
	res.Skipped = plan.Skipped
	nodes := plan.Nodes
	if plan.ClaimSize > 0 { // else a plan of an earlier release: a record per node (compat_node_records.go)
		lctx, stopLog := context.WithCancel(ctx)
		defer stopLog()
		r.claims, r.outcomes = newRangeClaimer(r, plan), r.startOutcomeLog(lctx)
	}
	allowed := cfg.FailureBudget.Allowed(len(nodes))
	res.MaxFailures, res.FailureBudget = cfg.FailureBudget.String(), allowed

	t := newTally(cfg, &res, len(nodes))
	batchIndex := 0
	stopped := ""
	onBatch := func(start, size int) bool {
		batchIndex++
		b := r.recordBatch(ctx, cfg, t, batchIndex, nodes[start:start+size])
		if cfg.StopBefore != nil && ctx.Err() == nil && st.actsOnAny(b.Nodes) {
			stopped = cfg.StopBefore(b)
		}
		return stopped == ""
	}
	batchOf := batchIndexer(len(nodes), cfg.InitialBatch)
	succeeded, batches, _, overBudget := slowStartBatch(len(nodes), cfg.InitialBatch, cfg.MaxInFlight, allowed, onBatch, func(i int) error {
		return r.runNode(ctx, st, t, i, nodes[i], batchOf(i))
	})
	res.Batches = append(res.Batches, batches...)
	res.Succeeded = succeeded
	t.close(&res)
	res.Duration = events.Duration{Duration: cfg.Clock().Sub(began)}
	if t.recordErr != nil {
		res.Error = t.recordErr.Error()
	}
	if ctx.Err() != nil {
		return res, fmt.Errorf("rollout %s: %w", cfg.ID, ctx.Err())
	}
	res.StopReason = events.RolloutCompleted
	if overBudget != nil { // the failures passed the budget: no batch started after
		res.StopReason = events.RolloutMaxFailuresExceeded
	}
	if stopped != "" {
		res.StopReason = stopped
		cfg.Logger.Info("rollout stopped before a batch", "rollout", cfg.ID, "batch", batchIndex, "reason", stopped,
			"not_started", len(nodes)-t.done)
	}
	if err := r.recordFinished(ctx, res); err != nil {
		return res, err
	}
	if t.recordErr != nil {
		return res, t.recordErr
	}
	return res, nil
}

// begin records the rollout's plan, or reads the plan of the rollout it resumes (or of the orchestrator
// that started it first), and returns what the stream holds of it. A resumed rollout keeps its recorded
// initial batch and failure budget (cfg is updated).
func (r *Rollout) begin(ctx context.Context, cfg *RolloutConfig, began time.Time) (rolloutState, events.RolloutStarted, error) {
	if err := bus.Retry(ctx, func(ctx context.Context) error {
		return EnsureRolloutStream(ctx, r.b, cfg.Replicas)
	}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second)); err != nil {
		return rolloutState{}, events.RolloutStarted{}, err
	}
	st, err := loadRollout(ctx, r.b, cfg.ID)
	if err != nil {
		return st, events.RolloutStarted{}, err
	}
	plan := events.RolloutStarted{ID: cfg.ID, Kind: cfg.Kind, Selector: cfg.Selector, InitialBatch: cfg.InitialBatch,
		NodeTimeout: events.Duration{Duration: cfg.NodeTimeout}, DryRun: cfg.DryRun, Image: cfg.Image, GC: cfg.GC,
		Nodes: append([]string{}, cfg.Nodes...), Skipped: cfg.Skipped, Time: began.UTC(), ClaimSize: min(claimSize, cfg.MaxInFlight)}
	if !cfg.FailureBudget.IsZero() {
		plan.MaxFailures = cfg.FailureBudget.String()
	}
	if st.started == nil {
		var won bool
		err := bus.Retry(ctx, func(ctx context.Context) error {
			var err error
			won, err = r.publishFirst(ctx, events.RolloutSubject(cfg.ID, events.RolloutStartedKind, ""), "started."+r.owner, plan)
			return err
		}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second))
		if err != nil {
			return st, plan, err
		}
		if !won { // another orchestrator started this rollout first: follow its plan
			if st, err = loadRollout(ctx, r.b, cfg.ID); err != nil {
				return st, plan, err
			}
		}
	}
	if st.started == nil {
		return st, plan, nil
	}
	if err := resume(cfg, *st.started, len(st.results)); err != nil {
		return st, plan, err
	}
	return st, *st.started, nil
}

// resume takes the recorded plan's kind, initial batch and failure budget into cfg: a resumed rollout stops
// where the one it resumes would have.
func resume(cfg *RolloutConfig, plan events.RolloutStarted, done int) error {
	if plan.Kind != cfg.Kind {
		return fmt.Errorf("rollout %s is a %s rollout, not %s", cfg.ID, plan.Kind, cfg.Kind)
	}
	cfg.InitialBatch = plan.InitialBatch
	budget := FailureBudget{}
	if plan.MaxFailures != "" {
		var err error
		if budget, err = ParseFailureBudget(plan.MaxFailures); err != nil {
			return fmt.Errorf("rollout %s: recorded max failures: %w", cfg.ID, err)
		}
	}
	if budget != cfg.FailureBudget && !cfg.FailureBudget.IsZero() {
		cfg.Logger.Warn("resumed rollout keeps its recorded failure budget", "rollout", cfg.ID,
			"max_failures", budget.String(), "asked", cfg.FailureBudget.String())
	}
	cfg.FailureBudget = budget
	cfg.Logger.Info("resuming rollout", "rollout", cfg.ID, "nodes", len(plan.Nodes), "done", done)
	return nil
}

// runNode acts on node i of the plan (at most once: Rollout.node) and reports its outcome; the error is the
// node's failure, for the slow start's failure budget.
func (r *Rollout) runNode(ctx context.Context, st rolloutState, t *tally, i int, node string, batch int) error {
	nr, err := r.node(ctx, st, i, node, batch)
	if err != nil {
		t.recordFailed(err)
		if nr.Node == "" { // not acted on: the claim could not be recorded
			nr = events.RolloutNodeResult{Node: node, Batch: batch}
		}
		nr.OK, nr.Error = false, err.Error()
	}
	t.report(i, nr)
	if !nr.OK {
		return fmt.Errorf("node %s: %s", node, nr.Error)
	}
	return nil
}

// recordBatch records batch index (informational: followers show it; losing it does not change any
// outcome), reports it to Progress and returns it.
func (r *Rollout) recordBatch(ctx context.Context, cfg RolloutConfig, t *tally, index int, nodes []string) events.RolloutBatch {
	b := events.RolloutBatch{Index: index, Size: len(nodes), Nodes: append([]string{}, nodes...), Time: cfg.Clock().UTC()}
	if err := bus.Retry(ctx, func(ctx context.Context) error {
		_, err := r.publish(ctx, events.RolloutSubject(cfg.ID, events.RolloutBatchKind, ""), fmt.Sprintf("batch.%d.%s", index, r.owner), b)
		return err
	}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second)); err != nil {
		cfg.Logger.Warn("record rollout batch failed", "rollout", cfg.ID, "err", err)
	}
	if cfg.Progress != nil {
		t.mu.Lock()
		p := Progress{Batch: &b, Done: t.done, Total: t.total}
		t.mu.Unlock()
		cfg.Progress(p)
	}
	return b
}

// recordFinished records the finished record: the summary. Each node's outcome is already a record of its
// own, and a thousand GC results would not fit in one message.
func (r *Rollout) recordFinished(ctx context.Context, res events.RolloutResult) error {
	summary := res
	summary.Nodes = nil
	return bus.Retry(ctx, func(ctx context.Context) error {
		_, err := r.publish(ctx, events.RolloutSubject(r.cfg.ID, events.RolloutFinishedKind, ""), "finished."+r.owner, summary)
		return err
	}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second))
}

// tally is what Run keeps of the outcomes: counts, sums, the first MaxFailures failures and, only without a
// Results sink, the outcomes themselves. mu guards them; outMu keeps the calls of Results one at a time.
type tally struct {
	cfg       RolloutConfig
	res       *events.RolloutResult // FailedCount and FreedBytes, under mu
	total     int
	mu, outMu sync.Mutex
	done      int
	failed    []indexedFailure
	held      []events.RolloutNodeResult
	have      []bool
	recordErr error // the first error recording an outcome
}

// indexedFailure is a failed node with its place in the plan (Failed is reported in plan order).
type indexedFailure struct {
	i   int
	err events.RolloutNodeError
}

func newTally(cfg RolloutConfig, res *events.RolloutResult, total int) *tally {
	t := &tally{cfg: cfg, res: res, total: total}
	if cfg.Results == nil {
		t.held, t.have = make([]events.RolloutNodeResult, total), make([]bool, total)
	}
	return t
}

// report counts node i's outcome in and hands it to Results and Progress.
func (t *tally) report(i int, nr events.RolloutNodeResult) {
	t.mu.Lock()
	t.done++
	if !nr.OK {
		t.res.FailedCount++
		if len(t.failed) < t.cfg.MaxFailures {
			t.failed = append(t.failed, indexedFailure{i, events.RolloutNodeError{Node: nr.Node, Error: nr.Error}})
		}
	}
	t.res.FreedBytes += nr.Counts().Bytes
	if t.held != nil {
		t.held[i], t.have[i] = nr, true
	}
	p := Progress{Node: &nr, Done: t.done, Total: t.total}
	t.mu.Unlock()
	if t.cfg.Results != nil {
		t.outMu.Lock()
		t.cfg.Results(nr)
		t.outMu.Unlock()
	}
	if t.cfg.Progress != nil {
		t.cfg.Progress(p)
	}
}

// recordFailed keeps the first error recording an outcome.
func (t *tally) recordFailed(err error) {
	t.mu.Lock()
	if t.recordErr == nil {
		t.recordErr = err
	}
	t.mu.Unlock()
}

// close puts the kept outcomes into res once every node has ended: the nodes not started, the failures
// and the held outcomes in plan order.
func (t *tally) close(res *events.RolloutResult) {
	res.NotStarted = t.total - t.done
	slices.SortFunc(t.failed, func(a, b indexedFailure) int { return a.i - b.i })
	for _, f := range t.failed {
		res.Failed = append(res.Failed, f.err)
	}
	for i := range t.held {
		if t.have[i] {
			res.Nodes = append(res.Nodes, t.held[i])
		}
	}
}
