package main

import (
	"bufio"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

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

// rolloutOutput writes a rollout's result to stdout as it happens: each node's outcome when it arrives, the
// totals at the end. With -o json it writes the document of docs/cli.md ({batches, succeeded, failed, dryRun,
// nodes: [...]} and the rest of events.RolloutResult) incrementally: "nodes" first, element by element in
// the order the nodes end, then the other fields; as text, one table row per node, then the totals.
type rolloutOutput struct {
	w     *bufio.Writer
	json  bool
	doc   jsonList // -o json: the document, its "nodes" written as they come
	kind  string
	width int // of the NODE column: the longest planned name
	n     int // nodes written
	err   error
}

func newRolloutOutput(w io.Writer, json bool, cfg fleet.RolloutConfig) *rolloutOutput {
	o := &rolloutOutput{w: bufio.NewWriter(w), json: json, kind: cfg.Kind, width: len("NODE")}
	o.doc = jsonList{w: o.w, field: "nodes"}
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
	if o.json {
		if o.err = o.doc.add(nr); o.err != nil {
			return
		}
	} else {
		if o.n == 0 {
			o.head()
		}
		o.row(nr)
	}
	o.n++
	o.err = o.w.Flush()
}

// head writes the table's header.
func (o *rolloutOutput) head() {
	if o.kind == events.RolloutGC {
		fmt.Fprintf(o.w, "%-*s  %5s  %-14s  %10s  %s\n", o.width, "NODE", "BATCH", "IMAGES", "BYTES", "STATUS")
	} else {
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
		// The rest of the result, without its (empty) nodes: the outer field hides the embedded one.
		rest := struct {
			events.RolloutResult
			Nodes *struct{} `json:"nodes,omitempty"`
		}{RolloutResult: res}
		if err := o.doc.close(rest); err != nil {
			return fmt.Errorf("write result: %w", err)
		}
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
