package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// The rollout engine: one action over many nodes, in slow-start batches, recorded.
//
// A rollout runs one NodeAction (GCAction, or a PullWatch's Action) over a planned list of nodes in the
// ReplicaSet controller's slow-start batches (slowstart.go), and records its plan, batches, claims, node
// outcomes and summary in the rollout stream (events.RolloutStream, rollout_stream.go). A driver (the CLI's
// fleet gc and fleet pull, a controller) uses this API and nothing else:
//
//   - Plan picks the nodes from the registry (plan.go), or the driver names them;
//   - NewRolloutID names a rollout; NodeRequestID names its request to one node (rollout_ids.go);
//   - NewRollout(RolloutConfig, bus, action) validates the config (rollout_config.go) and (*Rollout).Run
//     runs the rollout to its end (rollout_run.go), reporting as it goes through RolloutConfig.Progress and
//     RolloutConfig.Results, and returns the events.RolloutResult;
//   - LoadRollout reads what the stream holds of a rollout (LoadRolloutStarted only its plan), FollowRollout
//     follows it as it is written.
//
// The contract Run keeps:
//
//   - At most once per node: a node is acted on only once this run's claim on it is the first stored in the
//     stream (Rollout.node, rollout_node.go): the claim on its range of the plan, cut alike by every run
//     (rollout_claims.go). A node claimed without a recorded outcome (a run that died between the two) is
//     reported failed and never acted on again. Outcomes are stored in groups before their nodes count
//     (rollout_outcomes.go).
//   - Resumable: Run with the ID of an earlier rollout keeps the recorded plan, initial batch and failure
//     budget; a node with a recorded outcome is reported with it (Resumed) and not acted on. Several runs of
//     one ID may run at once: the first plan stored is everyone's, the first claim of a node decides who
//     acts on it.
//   - A failed node is in the result, not Run's error; Run's error is the rollout's own (the stream could
//     not be written, ctx ended). The rollout stops after the batch whose failures pass the FailureBudget.
//   - The action is given a ctx carrying the node timeout and must return once it ends; an action whose
//     request reaches a node sends NodeRequestID with it, so the node can answer a retried request from its
//     memory instead of acting twice (docs/architecture.md, "Flows").

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
	// Nodes are the nodes to act on, in order (required; see Plan to pick them from the registry).
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
	// StopBefore, when set, is asked at each batch's start, after Progress has had the batch: a reason
	// (not empty) ends the rollout there, no node of that batch or a later one acted on, and the finished
	// record carries the reason as its StopReason (a schedule's window that ended, say). Nothing is in flight
	// at a batch's start, so the rollout ends whole: a resumed one, or `fleet follow`, finds it finished.
	StopBefore func(events.RolloutBatch) string
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
	// claims and outcomes record the nodes a range and a group at a time; nil in a rollout whose plan an
	// earlier release recorded (a record per node).
	claims   *rangeClaimer
	outcomes *outcomeLog
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

// DefaultMaxInFlight is RolloutConfig.MaxInFlight's default: nodes acted on at once inside a batch.
const DefaultMaxInFlight = 1000
