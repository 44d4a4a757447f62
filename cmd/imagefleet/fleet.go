package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func newFleetCmd(cl *cli) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fleet",
		Short: "Fleet view and rollouts: nodes, images, where, gc, pull, follow",
	}
	cmd.AddCommand(newFleetNodesCmd(cl), newFleetImagesCmd(cl), newFleetWhereCmd(cl), newFleetGCCmd(cl), newFleetPullCmd(cl), newFleetFollowCmd(cl))
	return cmd
}

func newFleetNodesCmd(cl *cli) *cobra.Command {
	var lostAfter time.Duration
	var forget string
	var pf pageFlags
	cmd := &cobra.Command{
		Use:   "nodes [-l SELECTOR] [--limit N [--continue TOKEN]]",
		Short: "List the nodes that ever heartbeated, Ready or Lost, with the age of their last heartbeat",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			b, err := cl.connect(ctx, "imagefleet-fleet-nodes")
			if err != nil {
				return err
			}
			defer b.Close()
			reg, err := fleet.OpenRegistry(ctx, b, fleet.RegistryOptions{LostAfter: lostAfter})
			if err != nil {
				return err
			}
			if forget != "" {
				return reg.Forget(ctx, forget)
			}
			q, err := pf.nodeQuery()
			if err != nil {
				return err
			}
			page, err := reg.List(ctx, q)
			if err != nil {
				return err
			}
			return printNodesPage(cmd, cl.jsonOutput(), pf.paged(), page)
		},
	}
	cmd.Flags().DurationVar(&lostAfter, "lost-after", 0, "show a node as lost after this silence (default: 3 of its heartbeat periods)")
	cmd.Flags().StringVar(&forget, "forget", "", "remove a decommissioned node from the registry")
	pf.register(cmd, true)
	return cmd
}

// pageFlags are the paging and selection flags of fleet nodes, images and where.
type pageFlags struct {
	selector string
	limit    int
	cont     string
}

func (f *pageFlags) register(cmd *cobra.Command, selector bool) {
	if selector {
		cmd.Flags().StringVarP(&f.selector, "selector", "l", "", "label selector of the nodes (k=v,k2!=v2,k3 in (a,b)); default all")
	}
	cmd.Flags().IntVar(&f.limit, "limit", 0, "show at most this many, then the token that continues (0: all)")
	cmd.Flags().StringVar(&f.cont, "continue", "", "continue after the page that printed this token")
}

// paged reports whether the caller asked for pages: JSON output is then an object with the token.
func (f *pageFlags) paged() bool { return f.limit != 0 || f.cont != "" }

func (f *pageFlags) nodeQuery() (fleet.NodeQuery, error) {
	if f.limit < 0 {
		return fleet.NodeQuery{}, fmt.Errorf("--limit %d must not be negative", f.limit)
	}
	q := fleet.NodeQuery{Limit: f.limit, Continue: f.cont}
	if f.selector != "" {
		sel, err := fleet.ParseSelector(f.selector)
		if err != nil {
			return q, err
		}
		q.Selector = sel
	}
	return q, nil
}

// nodesPageJSON is `fleet nodes -o json` with --limit or --continue (without them: the array of nodes).
type nodesPageJSON struct {
	Nodes    []events.NodeStatus `json:"nodes"`
	Continue string              `json:"continue,omitempty"`
	Total    int                 `json:"total"`
}

func printNodesPage(cmd *cobra.Command, asJSON, paged bool, page fleet.NodePage) error {
	nodes := page.Nodes
	if nodes == nil {
		nodes = []events.NodeStatus{}
	}
	if asJSON && paged {
		return printJSON(cmd.OutOrStdout(), nodesPageJSON{Nodes: nodes, Continue: page.Continue, Total: page.Total})
	}
	if asJSON {
		return printJSON(cmd.OutOrStdout(), nodes)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tSTATE\tLAST HEARTBEAT\tRUNTIME\tIMAGE FS USED\tCAPACITY\tLABELS\tWORKERS")
	for _, n := range nodes {
		fmt.Fprintf(tw, "%s\t%s\t%s ago\t%s %s\t%s\t%s\t%s\t%s\n", n.Node, n.State, n.Age.Round(time.Second),
			n.RuntimeName, n.RuntimeVersion, FormatSize(n.ImageFs.UsedBytes), FormatSize(n.ImageFs.CapacityBytes),
			formatLabels(n.Labels), strings.Join(n.Workers, ","))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	printContinue(cmd, page.Continue)
	return nil
}

// printContinue tells on stderr how to get the next page (stdout keeps only the table).
func printContinue(cmd *cobra.Command, token string) {
	if token != "" {
		fmt.Fprintf(cmd.ErrOrStderr(), "more follow: --continue %s\n", token)
	}
}

func formatLabels(l map[string]string) string {
	keys := make([]string, 0, len(l))
	for k := range l {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + l[k]
	}
	return strings.Join(parts, ",")
}

// inventoryChunk is the page size in which fleet images|where fetch a whole answer when no --limit is given:
// one reply stays far under NATS's 1 MiB max payload (a where of an image on 10,000 nodes is ~3 MB).
const inventoryChunk = 1000

// inventoryQuery asks the inventory. With q.Limit set, one page; without, every page after q.Continue in
// chunks, joined into one answer.
func (cl *cli) inventoryQuery(cmd *cobra.Command, q events.InventoryQuery) (events.InventoryReply, error) {
	ctx, cancel := cl.contextTimeout(cmd.Context())
	defer cancel()
	b, err := cl.connect(ctx, "imagefleet-fleet-inventory")
	if err != nil {
		return events.InventoryReply{}, err
	}
	defer b.Close()
	ask := func(q events.InventoryQuery) (events.InventoryReply, error) {
		for attempt := 1; ; attempt++ {
			var rep events.InventoryReply
			err := b.Request(ctx, events.InventoryQuerySubject, q, &rep)
			if err == nil {
				return rep, nil
			}
			// A partitioned inventory whose partitions are being taken over answers in seconds.
			if !errors.Is(err, events.ErrPartsMissing) || attempt == 5 {
				return rep, fmt.Errorf("fleet inventory: %w", err)
			}
			select {
			case <-ctx.Done():
				return rep, fmt.Errorf("fleet inventory: %w", err)
			case <-time.After(time.Second):
			}
		}
	}
	if q.Limit > 0 {
		return ask(q)
	}
	q.Limit = inventoryChunk
	all, err := ask(q)
	if err != nil {
		return all, err
	}
	if n := len(all.Images) + len(all.Placements) + len(all.Nodes); q.Continue == "" && all.Continue == "" && n < all.Total {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: the inventory answered %d of %d (a replica of an earlier release does not page: upgrade it)\n", n, all.Total)
	}
	for next := all.Continue; next != ""; {
		q.Continue = next
		rep, err := ask(q)
		if err != nil {
			return all, err
		}
		all.Images = append(all.Images, rep.Images...)
		all.Placements = append(all.Placements, rep.Placements...)
		all.Nodes = append(all.Nodes, rep.Nodes...)
		next = rep.Continue
	}
	all.Continue = ""
	return all, nil
}

func newFleetImagesCmd(cl *cli) *cobra.Command {
	var pf pageFlags
	cmd := &cobra.Command{
		Use:   "images [--limit N [--continue TOKEN]]",
		Short: "Every image in the fleet: on how many nodes, and the bytes it takes in all (from the inventory)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			q, err := pf.inventoryQuery(events.InventoryQuery{What: events.InventoryImages})
			if err != nil {
				return err
			}
			rep, err := cl.inventoryQuery(cmd, q)
			if err != nil {
				return err
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tTAGS\tSIZE\tNODES\tTOTAL\tLAST USED")
			for _, im := range rep.Images {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", shortID(im.ID), strings.Join(im.RepoTags, ","), FormatSize(im.Size),
					im.Nodes, FormatSize(im.TotalBytes), fmtTime(im.LastUsed))
			}
			fmt.Fprintf(tw, "%d images\t\t\t\t%s\t\n", rep.Total, FormatSize(rep.TotalBytes))
			if err := tw.Flush(); err != nil {
				return err
			}
			printContinue(cmd, rep.Continue)
			return nil
		},
	}
	pf.register(cmd, false)
	return cmd
}

func newFleetWhereCmd(cl *cli) *cobra.Command {
	var pf pageFlags
	cmd := &cobra.Command{
		Use:   "where IMAGE [--limit N [--continue TOKEN]]",
		Short: "The nodes holding an image (by ID, ID prefix, tag or digest)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			q, err := pf.inventoryQuery(events.InventoryQuery{What: events.InventoryWhere, Image: args[0]})
			if err != nil {
				return err
			}
			rep, err := cl.inventoryQuery(cmd, q)
			if err != nil {
				return err
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NODE\tID\tTAGS\tSIZE\tIN USE\tLAST USED")
			for _, p := range rep.Placements {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%s\n", p.Node, shortID(p.ID), strings.Join(p.RepoTags, ","), FormatSize(p.Size), p.InUse, fmtTime(p.LastUsed))
			}
			fmt.Fprintf(tw, "%d nodes\t\t\t%s\t\t\n", rep.Total, FormatSize(rep.TotalBytes))
			if err := tw.Flush(); err != nil {
				return err
			}
			printContinue(cmd, rep.Continue)
			return nil
		},
	}
	pf.register(cmd, false)
	return cmd
}

// inventoryQuery adds the page flags to q.
func (f *pageFlags) inventoryQuery(q events.InventoryQuery) (events.InventoryQuery, error) {
	if f.limit < 0 {
		return q, fmt.Errorf("--limit %d must not be negative", f.limit)
	}
	q.Limit, q.Continue = f.limit, f.cont
	return q, nil
}

// rolloutFlags are the flags of fleet gc and fleet pull.
type rolloutFlags struct {
	id           string
	selector     string
	nodes        string
	initialBatch int
	nodeTimeout  time.Duration
	includeLost  bool
	replicas     int
	maxInFlight  int
	maxFailures  string
	memProfile   string
}

func (f *rolloutFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.id, "id", "", "rollout id (default: generated); the id of an earlier rollout resumes it, acting on no node twice")
	fs.StringVarP(&f.selector, "selector", "l", "", "label selector of the nodes (k=v,k2!=v2,k3 in (a,b)); default all")
	fs.StringVar(&f.nodes, "nodes", "", "act on exactly these nodes, in this order (instead of the registry and --selector)")
	fs.IntVar(&f.initialBatch, "initial-batch", fleet.SlowStartInitialBatchSize, "size of the first batch; each next batch doubles")
	fs.DurationVar(&f.nodeTimeout, "node-timeout", 60*time.Second, "a node that does not answer within this time has failed")
	fs.IntVar(&f.maxInFlight, "max-in-flight", fleet.DefaultMaxInFlight, "at most this many nodes acted on at once inside a batch (a batch still waits for all its nodes)")
	fs.StringVar(&f.maxFailures, "max-failures", "0", "failure budget: go on to the next batch while at most N nodes, or P% of the planned nodes (rounded down), have failed; 0 stops after the first batch with a failure. A resumed rollout keeps its budget")
	fs.BoolVar(&f.includeLost, "include-lost", false, "also act on nodes the registry shows as lost")
	fs.IntVar(&f.replicas, "stream-replicas", 0, "replicas of the rollout stream (3 on a 3-server cluster; 0: 1 if new, else kept)")
	fs.StringVar(&f.memProfile, "mem-profile", "", "write the orchestrator's allocation profile to this file at the end (diagnostics)")
	_ = fs.MarkHidden("mem-profile")
}

// writeMemProfile writes the allocation profile (every allocation site since start) for `go tool pprof`.
func writeMemProfile(path string) error {
	if path == "" {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("mem profile: %w", err)
	}
	defer f.Close()
	runtime.GC()
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		return fmt.Errorf("mem profile: %w", err)
	}
	return nil
}

// plan picks the nodes and builds the rollout config. From the registry (not --nodes), it also returns the
// planned nodes' JetStream domains as a pre-pull's option, read with the nodes: a pre-pull needs no second
// read of the registry.
func (f *rolloutFlags) plan(ctx context.Context, b *bus.Bus, kind string) (fleet.RolloutConfig, []fleet.PullWatchOption, error) {
	if f.initialBatch < 1 {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--initial-batch %d must be at least 1", f.initialBatch)
	}
	if f.maxInFlight < 1 {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--max-in-flight %d must be at least 1", f.maxInFlight)
	}
	budget, err := fleet.ParseFailureBudget(f.maxFailures)
	if err != nil {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--max-failures: %w", err)
	}
	cfg := fleet.RolloutConfig{ID: f.id, Kind: kind, Selector: f.selector, InitialBatch: f.initialBatch,
		NodeTimeout: f.nodeTimeout, Replicas: f.replicas, MaxInFlight: f.maxInFlight, FailureBudget: budget}
	if cfg.ID == "" {
		cfg.ID = fleet.NewRolloutID(kind)
	}
	if f.nodes != "" {
		for _, n := range strings.Split(f.nodes, ",") {
			if n = strings.TrimSpace(n); n != "" {
				cfg.Nodes = append(cfg.Nodes, n)
			}
		}
		return cfg, nil, nil
	}
	p, err := fleet.Plan(ctx, b, f.selector, f.includeLost, time.Now)
	cfg.Nodes, cfg.Skipped = p.Nodes, p.Skipped
	return cfg, []fleet.PullWatchOption{fleet.WithNodeDomains(p.Domains)}, err
}

// runRollout runs a rollout with a progress bar on a terminal, plain lines otherwise, and prints the result.
func (cl *cli) runRollout(cmd *cobra.Command, b *bus.Bus, cfg fleet.RolloutConfig, act fleet.NodeAction) error {
	errOut := cmd.ErrOrStderr()
	var bar *progressbar.ProgressBar
	var mu sync.Mutex
	if f, ok := errOut.(*os.File); ok && term.IsTerminal(int(f.Fd())) && len(cfg.Nodes) > 0 {
		bar = progressbar.NewOptions(len(cfg.Nodes), progressbar.OptionSetWriter(errOut),
			progressbar.OptionSetDescription(cfg.Kind+" "+cfg.ID), progressbar.OptionShowCount(),
			progressbar.OptionClearOnFinish(), progressbar.OptionSetPredictTime(false))
	}
	fmt.Fprintf(errOut, "rollout %s: %s on %d nodes, batches %v, max failures %s (%s)\n", cfg.ID, cfg.Kind, len(cfg.Nodes),
		fleet.PlanBatches(len(cfg.Nodes), cfg.InitialBatch), cfg.FailureBudget, nodeCount(cfg.FailureBudget.Allowed(len(cfg.Nodes))))
	cfg.Progress = func(p fleet.Progress) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case bar != nil && p.Node != nil:
			_ = bar.Add(1)
		case bar != nil && p.Batch != nil:
			bar.Describe(fmt.Sprintf("%s %s batch %d (%d nodes)", cfg.Kind, cfg.ID, p.Batch.Index, p.Batch.Size))
		case p.Batch != nil:
			fmt.Fprintf(errOut, "batch %d: %d nodes\n", p.Batch.Index, p.Batch.Size)
		case p.Node != nil:
			fmt.Fprintf(errOut, "[%d/%d] %s\n", p.Done, p.Total, nodeLine(*p.Node))
		}
	}
	// Node results go to stdout as they arrive (rolloutOutput): the orchestrator keeps none of them.
	out := newRolloutOutput(cmd.OutOrStdout(), cl.jsonOutput(), cfg)
	cfg.Results = out.node
	r, err := fleet.NewRollout(cfg, b, act)
	if err != nil {
		return err
	}
	res, runErr := r.Run(cmd.Context())
	if bar != nil {
		_ = bar.Finish()
	}
	if err := out.finish(res); err != nil {
		return errors.Join(runErr, err)
	}
	if runErr != nil {
		return runErr
	}
	// Any failed node exits 2, within the failure budget or not (as ansible-playbook exits 2 when a host
	// failed under max_fail_percentage): a rollout that went on past failures is not a clean success. The
	// message, and stopReason in the JSON, say whether it stopped.
	if n := res.FailedTotal(); n > 0 {
		return exitError{code: 2, err: fmt.Errorf("rollout %s: %d of %d nodes failed, %d not started; %s", res.ID, n, len(cfg.Nodes), res.NotStarted, budgetLine(res))}
	}
	return nil
}

// nodeCount is "1 node" or "N nodes".
func nodeCount(n int) string {
	if n == 1 {
		return "1 node"
	}
	return fmt.Sprintf("%d nodes", n)
}

// budgetLine says where a rollout's failures stand against its failure budget and why it stopped.
func budgetLine(res events.RolloutResult) string {
	budget := fmt.Sprintf("max failures %s (%s)", res.MaxFailures, nodeCount(res.FailureBudget))
	switch res.StopReason {
	case events.RolloutMaxFailuresExceeded:
		return fmt.Sprintf("%s exceeded: stopped after batch %d (%s)", budget, len(res.Batches), res.StopReason)
	case events.RolloutCompleted:
		return fmt.Sprintf("%s: within it, every batch ran (%s)", budget, res.StopReason)
	}
	return budget + ": interrupted"
}

func nodeLine(nr events.RolloutNodeResult) string {
	status := "ok"
	if !nr.OK {
		status = "FAILED: " + nr.Error
	}
	if nr.Resumed {
		status += " (earlier run)"
	}
	c := nr.Counts()
	switch {
	case nr.GC != nil && nr.GC.DryRun:
		return fmt.Sprintf("%s: would remove %d images, %s; %s", nr.Node, c.Removed, FormatSize(c.Bytes), status)
	case nr.GC != nil:
		return fmt.Sprintf("%s: removed %d, %d failed, freed %s; %s", nr.Node, c.Removed, c.Failed, FormatSize(c.Bytes), status)
	case nr.Pull != nil && nr.Pull.ImageRef != "":
		return fmt.Sprintf("%s: %s; %s", nr.Node, shortID(nr.Pull.ImageRef), status)
	}
	return nr.Node + ": " + status
}

// rolloutOutput writes a rollout's result to stdout as it happens: each node's outcome when it arrives, the
// totals at the end. With -o json it writes the document of docs/cli.md ({batches, succeeded, failed, dryRun,
// nodes: [...]} and the rest of events.RolloutResult) incrementally: "nodes" first, element by element in
// the order the nodes end, then the other fields; as text, one table row per node, then the totals.
type rolloutOutput struct {
	w     *bufio.Writer
	json  bool
	kind  string
	width int // of the NODE column: the longest planned name
	n     int // nodes written
	err   error
}

func newRolloutOutput(w io.Writer, json bool, cfg fleet.RolloutConfig) *rolloutOutput {
	o := &rolloutOutput{w: bufio.NewWriter(w), json: json, kind: cfg.Kind, width: len("NODE")}
	for _, n := range cfg.Nodes {
		o.width = max(o.width, min(len(n), 63))
	}
	return o
}

// node writes one node's outcome (Rollout calls it one at a time).
func (o *rolloutOutput) node(nr events.RolloutNodeResult) {
	if o.err != nil {
		return
	}
	if o.n == 0 {
		o.head()
	}
	o.n++
	if o.json {
		raw, err := json.MarshalIndent(nr, "    ", "  ")
		if err != nil {
			o.err = err
			return
		}
		if o.n > 1 {
			o.w.WriteString(",\n")
		}
		o.w.WriteString("    ")
		o.w.Write(raw)
	} else {
		o.row(nr)
	}
	o.err = o.w.Flush()
}

func (o *rolloutOutput) head() {
	switch {
	case o.json:
		o.w.WriteString("{\n  \"nodes\": [\n")
	case o.kind == events.RolloutGC:
		fmt.Fprintf(o.w, "%-*s  %5s  %-14s  %10s  %s\n", o.width, "NODE", "BATCH", "IMAGES", "BYTES", "STATUS")
	default:
		fmt.Fprintf(o.w, "%-*s  %5s  %-71s  %s\n", o.width, "NODE", "BATCH", "IMAGE REF", "STATUS")
	}
}

func (o *rolloutOutput) row(nr events.RolloutNodeResult) {
	status := "ok"
	if !nr.OK {
		status = "failed: " + nr.Error
	}
	if nr.Resumed {
		status += " (earlier run)"
	}
	if o.kind != events.RolloutGC {
		ref := "-"
		if nr.Pull != nil && nr.Pull.ImageRef != "" {
			ref = nr.Pull.ImageRef
		}
		fmt.Fprintf(o.w, "%-*s  %5d  %-71s  %s\n", o.width, nr.Node, nr.Batch, ref, status)
		return
	}
	imgs, size := "-", "-"
	if nr.GC != nil {
		c := nr.Counts()
		imgs, size = fmt.Sprint(c.Removed), FormatSize(c.Bytes)
		if c.Failed > 0 {
			imgs += fmt.Sprintf(" (%d failed)", c.Failed)
		}
		if nr.GC.DryRun { // what would go, by name (dry-run outcomes keep the list)
			var names []string
			for _, rm := range nr.GC.Removed {
				name := shortID(rm.ID)
				if len(rm.RepoTags) > 0 {
					name = rm.RepoTags[0]
				}
				names = append(names, name)
			}
			if len(names) > 0 {
				status += ": would remove " + strings.Join(names, ", ")
			}
		}
	}
	fmt.Fprintf(o.w, "%-*s  %5d  %-14s  %10s  %s\n", o.width, nr.Node, nr.Batch, imgs, size, status)
}

// finish writes the totals (and closes the JSON document); it returns the first write error.
func (o *rolloutOutput) finish(res events.RolloutResult) error {
	if o.err != nil {
		return fmt.Errorf("write result: %w", o.err)
	}
	if o.json {
		if o.n == 0 {
			o.w.WriteString("{\n  \"nodes\": [")
		} else {
			o.w.WriteString("\n  ")
		}
		// The rest of the result, without its (empty) nodes: the outer field hides the embedded one.
		rest, err := json.MarshalIndent(struct {
			events.RolloutResult
			Nodes *struct{} `json:"nodes,omitempty"`
		}{RolloutResult: res}, "", "  ")
		if err != nil {
			return fmt.Errorf("write result: %w", err)
		}
		o.w.WriteString("],\n")
		o.w.Write(bytes.TrimPrefix(rest, []byte("{\n")))
		o.w.WriteString("\n")
	} else {
		if o.n == 0 {
			o.head()
		}
		if res.Kind == events.RolloutGC {
			head := "freed"
			if res.DryRun {
				head = "would free"
			}
			fmt.Fprintf(o.w, "fleet total: %s %s\n", head, FormatSize(res.FreedBytes))
		}
		fmt.Fprintf(o.w, "rollout %s: batches %v, %d succeeded, %d failed, %d not started, %d skipped, in %s\n", res.ID, res.Batches,
			res.Succeeded, res.FailedTotal(), res.NotStarted, len(res.Skipped), res.Duration.Round(time.Millisecond))
		if res.FailedTotal() > 0 || res.FailureBudget > 0 {
			fmt.Fprintf(o.w, "%d failed, %s\n", res.FailedTotal(), budgetLine(res))
		}
		if len(res.Failed) < res.FailedTotal() {
			fmt.Fprintf(o.w, "(the first %d failures are kept in the result; every node's outcome is above)\n", len(res.Failed))
		}
		for _, s := range res.Skipped {
			fmt.Fprintf(o.w, "skipped %s: %s\n", s.Node, s.Error)
		}
	}
	if err := o.w.Flush(); err != nil {
		return fmt.Errorf("write result: %w", err)
	}
	return nil
}

func newFleetGCCmd(cl *cli) *cobra.Command {
	var f rolloutFlags
	var dryRun, allUnused bool
	cmd := &cobra.Command{
		Use:   "gc [--selector k=v] [--initial-batch 1] [--max-failures 0|N|P%] [--dry-run] [--node-timeout 60s]",
		Short: "Run image GC on the chosen nodes in slow-start batches (1, 2, 4 ...), stopping after a batch takes the failures past --max-failures",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-fleet-gc")
			if err != nil {
				return err
			}
			defer b.Close()
			pctx, cancel := cl.contextTimeout(ctx)
			cfg, _, err := f.plan(pctx, b, events.RolloutGC)
			cancel()
			if err != nil {
				return err
			}
			// The rollout id names each node's request (<id>.<node>): a node asked again after a lost reply
			// answers with its first pass's result.
			req := events.GCRequest{ID: cfg.ID, DryRun: dryRun, AllUnused: allUnused}
			cfg.DryRun, cfg.GC = dryRun, &req
			err = cl.runRollout(cmd, b, cfg, fleet.GCAction(b, req))
			return errors.Join(err, writeMemProfile(f.memProfile))
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what GC would remove on each node and the bytes it would free; remove nothing")
	cmd.Flags().BoolVar(&allUnused, "all-unused", false, "remove every eligible unused image (DeleteUnusedImages), not just down to the low threshold")
	return cmd
}

func newFleetPullCmd(cl *cli) *cobra.Command {
	var f rolloutFlags
	var policy string
	var allowPrivate bool
	cmd := &cobra.Command{
		Use:   "pull IMAGE [--selector k=v] [--initial-batch 1] [--max-failures 0|N|P%]",
		Short: "Pre-pull an image on the chosen nodes in slow-start batches",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-fleet-pull")
			if err != nil {
				return err
			}
			defer b.Close()
			pctx, cancel := cl.contextTimeout(ctx)
			cfg, watchOpts, err := f.plan(pctx, b, events.RolloutPull)
			cancel()
			if err != nil {
				return err
			}
			cfg.Image = args[0]
			// The plan's node records carry the nodes' domains: the registry is not read again.
			w, err := fleet.StartPullWatch(ctx, b, cfg.ID, args[0], policy, watchOpts...)
			if err != nil {
				return err
			}
			defer w.Stop()
			w.AllowPrivate = allowPrivate
			return cl.runRollout(cmd, b, cfg, w.Action())
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&policy, "policy", events.PullIfNotPresent, "pull policy: Always, IfNotPresent or Never")
	cmd.Flags().BoolVar(&allowPrivate, "allow-private", false, "let the pre-pull use the nodes' registry credentials (--node-keyring): pulled without the kubelet, the image has no kubelet pull record and, under the kubelet's default NeverVerifyPreloadedImages, every pod on the node may use it (docs/kubernetes.md)")
	return cmd
}

func newFleetFollowCmd(cl *cli) *cobra.Command {
	var wait bool
	cmd := &cobra.Command{
		Use:   "follow ID",
		Short: "Follow a rollout as it happens (or replay a finished one) from its event stream",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := args[0]
			if err := events.ValidateRolloutID(id); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-fleet-follow")
			if err != nil {
				return err
			}
			defer b.Close()
			if !wait {
				sctx, cancel := cl.contextTimeout(ctx)
				started, _, _, err := fleet.LoadRollout(sctx, b, id)
				cancel()
				if err != nil {
					return err
				}
				if started == nil {
					return fmt.Errorf("rollout %s not found (use --wait to wait for it)", id)
				}
			}
			out := cmd.OutOrStdout()
			var final *events.RolloutResult
			err = fleet.FollowRollout(ctx, b, id, func(ev fleet.RolloutEvent) bool {
				if cl.jsonOutput() {
					_ = printJSON(out, ev)
				} else {
					ts := ev.Time.Local().Format("15:04:05.000")
					switch {
					case ev.Started != nil:
						maxFailures := ev.Started.MaxFailures
						if maxFailures == "" {
							maxFailures = "0"
						}
						fmt.Fprintf(out, "%s started %s on %d nodes (selector %q, initial batch %d, max failures %s, dry run %v)\n", ts, ev.Started.Kind,
							len(ev.Started.Nodes), ev.Started.Selector, ev.Started.InitialBatch, maxFailures, ev.Started.DryRun)
					case ev.Batch != nil:
						fmt.Fprintf(out, "%s batch %d: %d nodes\n", ts, ev.Batch.Index, ev.Batch.Size)
					case ev.Claim != nil:
					case ev.Node != nil:
						fmt.Fprintf(out, "%s %s\n", ts, nodeLine(*ev.Node))
					case ev.Finished != nil:
						fmt.Fprintf(out, "%s finished: batches %v, %d succeeded, %d failed, %d not started", ts, ev.Finished.Batches,
							ev.Finished.Succeeded, ev.Finished.FailedTotal(), ev.Finished.NotStarted)
						if ev.Finished.StopReason != "" { // a summary of this release
							fmt.Fprintf(out, "; %s", budgetLine(*ev.Finished))
						}
						fmt.Fprintln(out)
					}
				}
				if ev.Finished != nil {
					final = ev.Finished
					return false
				}
				return true
			})
			if err != nil {
				return err
			}
			if final != nil && final.FailedTotal() > 0 {
				return exitError{code: 2, err: fmt.Errorf("rollout %s: %d nodes failed", id, final.FailedTotal())}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "wait for a rollout that has not started yet")
	return cmd
}
