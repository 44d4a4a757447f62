package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// runRollout runs a rollout with a progress bar on a terminal, plain lines otherwise, and prints the result.
func (cl *cli) runRollout(cmd *cobra.Command, b *bus.Bus, cfg fleet.RolloutConfig, act fleet.NodeAction) error {
	errOut := cmd.ErrOrStderr()
	progress := newRolloutProgress(errOut, cfg)
	fmt.Fprintf(errOut, "rollout %s: %s on %d nodes, batches %v, max failures %s (%s)\n", cfg.ID, cfg.Kind, len(cfg.Nodes),
		fleet.PlanBatches(len(cfg.Nodes), cfg.InitialBatch), cfg.FailureBudget, nodeCount(cfg.FailureBudget.Allowed(len(cfg.Nodes))))
	cfg.Progress = progress.report
	// Node results go to stdout as they arrive (rolloutOutput): the orchestrator keeps none of them.
	out := newRolloutOutput(cmd.OutOrStdout(), cl.jsonOutput(), cfg)
	cfg.Results = out.node
	r, err := fleet.NewRollout(cfg, b, act)
	if err != nil {
		return err
	}
	res, runErr := r.Run(cmd.Context())
	progress.finish()
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
