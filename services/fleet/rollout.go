package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
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

// validate checks cfg with exact messages and fills the defaults.
func (c *RolloutConfig) validate() error {
	if c.ID == "" {
		c.ID = NewRolloutID(c.Kind)
	}
	if err := events.ValidateRolloutID(c.ID); err != nil {
		return err
	}
	switch c.Kind {
	case events.RolloutGC, events.RolloutPull:
	default:
		return fmt.Errorf("rollout kind %q must be gc or pull", c.Kind)
	}
	if c.InitialBatch < 0 {
		return fmt.Errorf("initial batch %d must be at least 1", c.InitialBatch)
	}
	if c.InitialBatch == 0 {
		c.InitialBatch = SlowStartInitialBatchSize
	}
	if c.MaxInFlight < 0 {
		return fmt.Errorf("max in flight %d must be at least 1", c.MaxInFlight)
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxFailures < 0 {
		return fmt.Errorf("max failures %d must not be negative", c.MaxFailures)
	}
	if c.MaxFailures == 0 {
		c.MaxFailures = 1000
	}
	if err := c.FailureBudget.validate(); err != nil {
		return err
	}
	if c.NodeTimeout < 0 {
		return fmt.Errorf("node timeout %v must not be negative", c.NodeTimeout)
	}
	if c.NodeTimeout == 0 {
		c.NodeTimeout = 60 * time.Second
	}
	seen := map[string]bool{}
	for _, n := range c.Nodes {
		if err := events.ValidateNodeName(n); err != nil {
			return err
		}
		if seen[n] {
			return fmt.Errorf("node %s is listed twice", n)
		}
		seen[n] = true
	}
	if c.Kind == events.RolloutPull && c.Image == "" {
		return fmt.Errorf("a pull rollout needs an image")
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// FailureBudget is how many of a rollout's planned nodes may fail before it stops: a count, or a percentage
// of the planned nodes, as a Deployment's maxUnavailable (an int or a percent) and Ansible's
// max_fail_percentage. The rollout goes on, batch by batch, while the nodes failed so far number at most
// Allowed(planned), and stops after the batch that takes them over it. The zero value allows none.
type FailureBudget struct {
	// N is the count, or with Percent the percentage of the planned nodes (0-100).
	N       int
	Percent bool
}

// ParseFailureBudget parses a budget as --max-failures takes it: a count ("10") or a whole percentage of
// the planned nodes ("5%").
func ParseFailureBudget(s string) (FailureBudget, error) {
	num, pct := strings.CutSuffix(s, "%")
	n, err := strconv.Atoi(num)
	if err != nil || num == "" || strings.TrimSpace(num) != num || strings.HasPrefix(num, "+") {
		return FailureBudget{}, fmt.Errorf("%q is not a count (10) or a whole percentage of the planned nodes (5%%)", s)
	}
	if n < 0 {
		return FailureBudget{}, fmt.Errorf("%q must not be negative", s)
	}
	if pct && n > 100 {
		return FailureBudget{}, fmt.Errorf("%q must be at most 100%%", s)
	}
	return FailureBudget{N: n, Percent: pct}, nil
}

// String is the budget as ParseFailureBudget reads it ("0", "10", "5%").
func (b FailureBudget) String() string {
	if b.Percent {
		return strconv.Itoa(b.N) + "%"
	}
	return strconv.Itoa(b.N)
}

// IsZero reports whether the budget allows no failure whatever the rollout's size.
func (b FailureBudget) IsZero() bool { return b.N == 0 }

// Allowed is the number of failed nodes the budget allows in a rollout of planned nodes. A percentage is
// rounded down, as a Deployment's maxUnavailable is: the budget never allows more than its share (5% of 30
// nodes allows 1, 1% of 50 allows none), so a rollout stops when more than P% of its nodes failed, as
// Ansible's max_fail_percentage does.
func (b FailureBudget) Allowed(planned int) int {
	if b.Percent {
		return planned * b.N / 100
	}
	return b.N
}

func (b FailureBudget) validate() error {
	if b.N < 0 {
		return fmt.Errorf("max failures %s must not be negative", b)
	}
	if b.Percent && b.N > 100 {
		return fmt.Errorf("max failures %s must be at most 100%%", b)
	}
	return nil
}

// NewRolloutID returns a fresh rollout id: <kind>-<utc time>-<random>.
func NewRolloutID(kind string) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	if kind == "" {
		kind = "rollout"
	}
	return kind + "-" + time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// EnsureRolloutStream creates or updates the rollout stream.
func EnsureRolloutStream(ctx context.Context, b *bus.Bus, replicas int) error {
	return b.EnsureStream(ctx, bus.StreamConfig{Name: events.RolloutStream, Subjects: []string{events.RolloutSubjects},
		MaxAge: 30 * 24 * time.Hour, MaxBytes: 1 << 30, Replicas: replicas})
}

// rolloutState is what the rollout stream already holds about a rollout.
type rolloutState struct {
	started *events.RolloutStarted
	claims  map[string]events.RolloutClaim
	results map[string]events.RolloutNodeResult
}

// LoadRollout reads everything recorded about rollout id.
func LoadRollout(ctx context.Context, b *bus.Bus, id string) (*events.RolloutStarted, map[string]events.RolloutClaim, map[string]events.RolloutNodeResult, error) {
	st, err := loadRollout(ctx, b, id)
	if err != nil {
		return nil, nil, nil, err
	}
	return st.started, st.claims, st.results, nil
}

func loadRollout(ctx context.Context, b *bus.Bus, id string) (rolloutState, error) {
	st := rolloutState{claims: map[string]events.RolloutClaim{}, results: map[string]events.RolloutNodeResult{}}
	// A rollout that never started has nothing to read: one direct lookup instead of a scan.
	if _, err := b.LastMsg(ctx, events.RolloutStream, events.RolloutSubject(id, events.RolloutStartedKind, "")); err != nil {
		if errors.Is(err, bus.ErrNoMessage) {
			return st, nil
		}
		return st, fmt.Errorf("load rollout %s: %w", id, err)
	}
	err := b.ReadStream(ctx, events.RolloutStream, events.RolloutFilter(id), 0, func(m bus.StreamMsg) bool {
		rest := strings.TrimPrefix(m.Subject, events.Prefix+".fleet.rollout."+id+".")
		kind, _, _ := strings.Cut(rest, ".")
		switch kind {
		case events.RolloutStartedKind:
			var s events.RolloutStarted
			if json.Unmarshal(m.Data, &s) == nil && st.started == nil {
				st.started = &s
			}
		case events.RolloutClaimKind:
			var c events.RolloutClaim
			if json.Unmarshal(m.Data, &c) == nil {
				if _, ok := st.claims[c.Node]; !ok {
					st.claims[c.Node] = c
				}
			}
		case events.RolloutNodeKind:
			var r events.RolloutNodeResult
			if json.Unmarshal(m.Data, &r) == nil {
				if _, ok := st.results[r.Node]; !ok {
					st.results[r.Node] = r
				}
			}
		}
		return true
	})
	if err != nil {
		return st, fmt.Errorf("load rollout %s: %w", id, err)
	}
	return st, nil
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

// node runs the action on one node at most once per rollout. The error is for recording problems only;
// the node's own failure is in the result.
func (r *Rollout) node(ctx context.Context, st rolloutState, node string, batch int) (events.RolloutNodeResult, error) {
	cfg := r.cfg
	if prev, ok := st.results[node]; ok {
		prev.Resumed = true
		return prev, nil
	}
	if c, ok := st.claims[node]; ok {
		return events.RolloutNodeResult{Node: node, Batch: batch, Resumed: true,
			Error: fmt.Sprintf("claimed by run %s at %s without a recorded outcome; not acted on again", c.Owner, c.Time.Format(time.RFC3339))}, nil
	}
	claim := events.RolloutClaim{Node: node, Owner: r.owner, Batch: batch, Time: cfg.Clock().UTC()}
	claimSubject := events.RolloutSubject(cfg.ID, events.RolloutClaimKind, node)
	var claimed bool
	if err := retryTransientFor(ctx, recordRetryFor, func(ctx context.Context) error {
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
	}); err != nil {
		return events.RolloutNodeResult{}, fmt.Errorf("claim node %s: %w", node, err)
	}
	if !claimed {
		return events.RolloutNodeResult{Node: node, Batch: batch, Resumed: true,
			Error: "claimed by another run of this rollout; not acted on again"}, nil
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
	if err := retryTransientFor(ctx, recordRetryFor, func(ctx context.Context) error {
		_, err := r.publish(ctx, events.RolloutSubject(cfg.ID, events.RolloutNodeKind, node), "node."+events.NodeToken(node), rec)
		return err
	}); err != nil {
		return nr, fmt.Errorf("record outcome of node %s: %w", node, err)
	}
	return nr, nil
}

func (r *Rollout) publish(ctx context.Context, subject, id string, v any) (uint64, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("marshal %s: %w", subject, err)
	}
	return r.b.PublishStored(ctx, bus.RawMsg{Subject: subject, MsgID: r.cfg.ID + "." + id, Data: raw,
		Header: map[string]string{"content-type": "application/json"}})
}

func (r *Rollout) publishFirst(ctx context.Context, subject, id string, v any) (bool, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return false, fmt.Errorf("marshal %s: %w", subject, err)
	}
	return r.b.PublishFirst(ctx, bus.RawMsg{Subject: subject, MsgID: r.cfg.ID + "." + id, Data: raw,
		Header: map[string]string{"content-type": "application/json"}})
}

// firstClaimIsOurs reports whether the first claim stored on subject is this run's.
func (r *Rollout) firstClaimIsOurs(ctx context.Context, subject string) (bool, error) {
	var first *events.RolloutClaim
	err := r.b.ReadStream(ctx, events.RolloutStream, subject, 0, func(m bus.StreamMsg) bool {
		var c events.RolloutClaim
		if json.Unmarshal(m.Data, &c) != nil {
			return true // a damaged record is skipped, as loadRollout does
		}
		first = &c
		return false
	})
	if err != nil {
		return false, fmt.Errorf("read claim %s: %w", subject, err)
	}
	return first != nil && first.Owner == r.owner, nil
}

// recordRetryFor bounds the retries of a claim and of an outcome record: long enough for a cluster that
// lost a server to elect new leaders under load, and within the stream's 2-minute duplicate window, so a
// retried outcome is still stored once.
const recordRetryFor = 90 * time.Second

// retryTransient retries f while it fails with a transient bus error (a cluster server went away, a stream
// leader election), for up to 30 s. Every write it wraps is idempotent (Nats-Msg-Id). Each attempt gets its
// own context of at most bus.AttemptTimeout: a publish whose ack is lost with a killed server (the message
// stored, the ack routed through the dead server) would otherwise wait out the caller's whole deadline (a
// pre-pull's 90 s node timeout, CI's fleet test) instead of being sent again and answered as a duplicate.
func retryTransient(ctx context.Context, f func(attempt context.Context) error) error {
	return retryTransientFor(ctx, 30*time.Second, f)
}

// retryTransientFor is retryTransient retrying for up to maxElapsed.
func retryTransientFor(ctx context.Context, maxElapsed time.Duration, f func(attempt context.Context) error) error {
	deadline := time.Now().Add(maxElapsed)
	wait := 50 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, bus.AttemptTimeout)
		err := f(actx)
		cancel()
		if err == nil || !bus.IsTransient(err) || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// batchIndexer maps a call index to its 1-based batch number under the slow-start plan.
func batchIndexer(count, initial int) func(int) int {
	plan := PlanBatches(count, initial)
	return func(i int) int {
		end := 0
		for b, size := range plan {
			end += size
			if i < end {
				return b + 1
			}
		}
		return len(plan)
	}
}
