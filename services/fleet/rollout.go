package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// NodeAction acts on one node (a GC, a pull) and reports the outcome. It must return once ctx ends: ctx
// carries the node timeout.
type NodeAction func(ctx context.Context, node string) events.RolloutNodeResult

// RolloutConfig configures one rollout.
type RolloutConfig struct {
	// ID names the rollout (default: generated). Running again with the ID of an earlier rollout resumes
	// it: its plan is kept, nodes with an outcome are not acted on again, and nodes claimed without an
	// outcome count as failed (they may have been acted on: at most once).
	ID string
	// Kind is gc or pull (required).
	Kind string
	// Nodes are the nodes to act on, in order (required; see PlanNodes to pick them from the registry).
	Nodes []string
	// Skipped are nodes the selection left out and why (reported as is).
	Skipped []events.RolloutNodeError
	// Selector is the selector the nodes were picked with (recorded as is).
	Selector string
	// InitialBatch is the size of the first batch (default SlowStartInitialBatchSize = 1).
	InitialBatch int
	// NodeTimeout bounds each node's action; a node that does not answer in time has failed (default 60s).
	NodeTimeout time.Duration
	// DryRun, GC and Image are recorded in the plan (the action does the work).
	DryRun bool
	GC     *events.GCRequest
	Image  string
	// Replicas of the rollout stream (3 on a 3-server cluster; 0: the connection's Options.Replicas).
	Replicas int
	// FailureBudget is how many of the planned nodes may fail before the rollout stops (default: none, the
	// ReplicaSet controller's rule: stop after the first batch with a failure). It is recorded in the plan:
	// a resumed rollout keeps the budget it started with.
	FailureBudget FailureBudget
	// MaxInFlight caps the nodes acted on at once inside a batch (default DefaultMaxInFlight; the last batch
	// is about half the fleet). A batch still ends when all its nodes have ended and a failed batch still
	// stops the rollout: the cap changes when a node is acted on, never whether.
	MaxInFlight int
	// Results, when set, receives each node's outcome as soon as it is known, one call at a time, in the
	// order the nodes end (resumed nodes included), and Run keeps no outcome: RolloutResult.Nodes stays
	// empty, and the orchestrator's memory holds counts, sums and at most MaxFailures failures, whatever the
	// fleet's size. Without Results, RolloutResult.Nodes holds every outcome, in plan order.
	Results func(events.RolloutNodeResult)
	// MaxFailures bounds RolloutResult.Failed (default 1,000); RolloutResult.FailedCount counts them all.
	MaxFailures int
	// Progress, when set, is called after each node's outcome and each batch start (from several
	// goroutines; it must be safe for that).
	Progress func(Progress)
	// Clock returns now (default time.Now).
	Clock func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Progress is a rollout's progress as it happens.
type Progress struct {
	// Batch is set when a batch starts.
	Batch *events.RolloutBatch
	// Node is set when a node's outcome is known.
	Node *events.RolloutNodeResult
	// Done and Total count nodes.
	Done, Total int
}

// Rollout runs an action over nodes in slow-start batches and records it in the rollout stream.
type Rollout struct {
	cfg   RolloutConfig
	b     *bus.Bus
	act   NodeAction
	owner string
}

// NewRollout validates cfg and prepares the rollout.
func NewRollout(cfg RolloutConfig, b *bus.Bus, act NodeAction) (*Rollout, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if b == nil || act == nil {
		return nil, fmt.Errorf("rollout needs a bus and an action")
	}
	var tok [8]byte
	_, _ = rand.Read(tok[:])
	return &Rollout{cfg: cfg, b: b, act: act, owner: hex.EncodeToString(tok[:])}, nil
}

// ID returns the rollout's id.
func (r *Rollout) ID() string { return r.cfg.ID }

// Run runs the rollout and returns its result. A failed node is in the result, not an error; the error is
// for the rollout itself (the stream cannot be written, ctx ended).
func (r *Rollout) Run(ctx context.Context) (events.RolloutResult, error) {
	cfg := r.cfg
	began := cfg.Clock()
	res := events.RolloutResult{ID: cfg.ID, Kind: cfg.Kind, DryRun: cfg.DryRun, Started: began.UTC(),
		Failed: []events.RolloutNodeError{}, Nodes: []events.RolloutNodeResult{}, Batches: []int{}}
	if err := retryTransient(ctx, func(ctx context.Context) error { return EnsureRolloutStream(ctx, r.b, cfg.Replicas) }); err != nil {
		return res, err
	}
	st, err := loadRollout(ctx, r.b, cfg.ID)
	if err != nil {
		return res, err
	}
	plan := events.RolloutStarted{ID: cfg.ID, Kind: cfg.Kind, Selector: cfg.Selector, InitialBatch: cfg.InitialBatch,
		NodeTimeout: events.Duration{Duration: cfg.NodeTimeout}, DryRun: cfg.DryRun, Image: cfg.Image, GC: cfg.GC,
		Nodes: append([]string{}, cfg.Nodes...), Skipped: cfg.Skipped, Time: began.UTC()}
	if !cfg.FailureBudget.IsZero() {
		plan.MaxFailures = cfg.FailureBudget.String()
	}
	if st.started == nil {
		var won bool
		err := retryTransient(ctx, func(ctx context.Context) error {
			var err error
			won, err = r.publishFirst(ctx, events.RolloutSubject(cfg.ID, events.RolloutStartedKind, ""), "started."+r.owner, plan)
			return err
		})
		if err != nil {
			return res, err
		}
		if !won { // another orchestrator started this rollout first: follow its plan
			if st, err = loadRollout(ctx, r.b, cfg.ID); err != nil {
				return res, err
			}
		}
	}
	if st.started != nil {
		if st.started.Kind != cfg.Kind {
			return res, fmt.Errorf("rollout %s is a %s rollout, not %s", cfg.ID, st.started.Kind, cfg.Kind)
		}
		plan = *st.started
		cfg.InitialBatch = plan.InitialBatch
		res.DryRun = plan.DryRun
		// The budget is the plan's: a resumed rollout stops where the one it resumes would have.
		budget := FailureBudget{}
		if plan.MaxFailures != "" {
			if budget, err = ParseFailureBudget(plan.MaxFailures); err != nil {
				return res, fmt.Errorf("rollout %s: recorded max failures: %w", cfg.ID, err)
			}
		}
		if budget != cfg.FailureBudget && !cfg.FailureBudget.IsZero() {
			cfg.Logger.Warn("resumed rollout keeps its recorded failure budget", "rollout", cfg.ID,
				"max_failures", budget.String(), "asked", cfg.FailureBudget.String())
		}
		cfg.FailureBudget = budget
		cfg.Logger.Info("resuming rollout", "rollout", cfg.ID, "nodes", len(plan.Nodes), "done", len(st.results))
	}
	res.Skipped = plan.Skipped
	nodes := plan.Nodes
	allowed := cfg.FailureBudget.Allowed(len(nodes))
	res.MaxFailures, res.FailureBudget = cfg.FailureBudget.String(), allowed

	// What Run keeps of the outcomes: counts, sums, the first MaxFailures failures and, only without a
	// Results sink, the outcomes themselves. mu guards them; outMu keeps the calls of Results one at a time.
	var (
		mu, outMu sync.Mutex
		done      int
		failed    []indexedFailure
		held      []events.RolloutNodeResult
		have      []bool
		recordErr error
	)
	if cfg.Results == nil {
		held, have = make([]events.RolloutNodeResult, len(nodes)), make([]bool, len(nodes))
	}
	report := func(i int, nr events.RolloutNodeResult) {
		mu.Lock()
		done++
		if !nr.OK {
			res.FailedCount++
			if len(failed) < cfg.MaxFailures {
				failed = append(failed, indexedFailure{i, events.RolloutNodeError{Node: nr.Node, Error: nr.Error}})
			}
		}
		res.FreedBytes += nr.Counts().Bytes
		if held != nil {
			held[i], have[i] = nr, true
		}
		p := Progress{Node: &nr, Done: done, Total: len(nodes)}
		mu.Unlock()
		if cfg.Results != nil {
			outMu.Lock()
			cfg.Results(nr)
			outMu.Unlock()
		}
		if cfg.Progress != nil {
			cfg.Progress(p)
		}
	}
	batchIndex := 0
	onBatch := func(start, size int) {
		batchIndex++
		b := events.RolloutBatch{Index: batchIndex, Size: size, Nodes: append([]string{}, nodes[start:start+size]...), Time: cfg.Clock().UTC()}
		// The batch record is informational (followers show it); losing it does not change any outcome.
		if err := retryTransient(ctx, func(ctx context.Context) error {
			_, err := r.publish(ctx, events.RolloutSubject(cfg.ID, events.RolloutBatchKind, ""), fmt.Sprintf("batch.%d.%s", batchIndex, r.owner), b)
			return err
		}); err != nil {
			cfg.Logger.Warn("record rollout batch failed", "rollout", cfg.ID, "err", err)
		}
		if cfg.Progress != nil {
			mu.Lock()
			p := Progress{Batch: &b, Done: done, Total: len(nodes)}
			mu.Unlock()
			cfg.Progress(p)
		}
	}
	batchOf := batchIndexer(len(nodes), cfg.InitialBatch)
	succeeded, batches, _, overBudget := slowStartBatchBudget(len(nodes), cfg.InitialBatch, cfg.MaxInFlight, allowed, onBatch, func(i int) error {
		node := nodes[i]
		nr, err := r.node(ctx, st, node, batchOf(i))
		if err != nil {
			mu.Lock()
			if recordErr == nil {
				recordErr = err
			}
			mu.Unlock()
			if nr.Node == "" { // not acted on: the claim could not be recorded
				nr = events.RolloutNodeResult{Node: node, Batch: batchOf(i)}
			}
			nr.OK, nr.Error = false, err.Error()
		}
		report(i, nr)
		if !nr.OK {
			return fmt.Errorf("node %s: %s", node, nr.Error)
		}
		return nil
	})
	res.Batches = append(res.Batches, batches...)
	res.Succeeded = succeeded
	res.NotStarted = len(nodes) - done
	slices.SortFunc(failed, func(a, b indexedFailure) int { return a.i - b.i })
	for _, f := range failed {
		res.Failed = append(res.Failed, f.err)
	}
	for i := range held {
		if have[i] {
			res.Nodes = append(res.Nodes, held[i])
		}
	}
	res.Duration = events.Duration{Duration: cfg.Clock().Sub(began)}
	if recordErr != nil {
		res.Error = recordErr.Error()
	}
	if ctx.Err() != nil {
		return res, fmt.Errorf("rollout %s: %w", cfg.ID, ctx.Err())
	}
	res.StopReason = events.RolloutCompleted
	if overBudget != nil { // the failures passed the budget: no batch started after
		res.StopReason = events.RolloutMaxFailuresExceeded
	}
	// The finished record is the summary: each node's outcome is already a record of its own, and a
	// thousand GC results would not fit in one message.
	summary := res
	summary.Nodes = nil
	if err := retryTransient(ctx, func(ctx context.Context) error {
		_, err := r.publish(ctx, events.RolloutSubject(cfg.ID, events.RolloutFinishedKind, ""), "finished."+r.owner, summary)
		return err
	}); err != nil {
		return res, err
	}
	if recordErr != nil {
		return res, recordErr
	}
	return res, nil
}

// DefaultMaxInFlight is RolloutConfig.MaxInFlight's default: nodes acted on at once inside a batch.
const DefaultMaxInFlight = 1000

// indexedFailure is a failed node with its place in the plan (Failed is reported in plan order).
type indexedFailure struct {
	i   int
	err events.RolloutNodeError
}
