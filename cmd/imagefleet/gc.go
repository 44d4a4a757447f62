package main

import (
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/gc"
)

func newGCCmd(cl *cli) *cobra.Command {
	var (
		node              string
		dryRun, allUnused bool
		high, low         int
		minAge, maxAge    time.Duration
	)
	cmd := &cobra.Command{
		Use:   "gc --node N [--dry-run] [--all-unused] [policy overrides]",
		Short: "Run image garbage collection on a node now (the kubelet's policy, or DeleteUnusedImages with --all-unused)",
		Long: `Ask the node's GC executor for one image GC pass and print what it removed and kept.
Without --all-unused it is the kubelet's GarbageCollect: free images (least recently used first) when the
image filesystem usage is at or above the high threshold, down to the low threshold, and remove unused images
older than the maximum age. With --all-unused it is DeleteUnusedImages: every unused image old enough.
Policy flags override the agent's configuration for this pass only. Exits non-zero when the pass failed.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			req := events.GCRequest{DryRun: dryRun, AllUnused: allUnused}
			fl := cmd.Flags()
			if fl.Changed("image-gc-high-threshold") {
				req.HighThresholdPercent = &high
			}
			if fl.Changed("image-gc-low-threshold") {
				req.LowThresholdPercent = &low
			}
			if fl.Changed("minimum-image-ttl-duration") {
				req.MinAge = &events.Duration{Duration: minAge}
			}
			if fl.Changed("image-maximum-gc-age") {
				req.MaxAge = &events.Duration{Duration: maxAge}
			}
			if err := req.Validate(); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-gc")
			if err != nil {
				return err
			}
			defer b.Close()
			rctx, cancel := cl.contextTimeout(ctx)
			defer cancel()
			var res events.GCResult
			if err := b.Request(rctx, events.CommandSubject(node, events.VerbGC), req, &res); err != nil {
				return fmt.Errorf("gc on %s: %w", node, err)
			}
			if cl.jsonOutput() {
				if err := printJSON(cmd.OutOrStdout(), res); err != nil {
					return err
				}
			} else if err := printGCResult(cmd, res); err != nil {
				return err
			}
			if res.Error != "" {
				return exitError{code: 1, err: errors.New(res.Error)}
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&node, "node", "", "node name")
	fs.BoolVar(&dryRun, "dry-run", false, "plan only: print what would be removed, remove nothing")
	fs.BoolVar(&allUnused, "all-unused", false, "remove every unused image old enough (the kubelet's DeleteUnusedImages)")
	fs.IntVar(&high, "image-gc-high-threshold", 0, "override the high threshold percent for this pass")
	fs.IntVar(&low, "image-gc-low-threshold", 0, "override the low threshold percent for this pass")
	fs.DurationVar(&minAge, "minimum-image-ttl-duration", 0, "override the minimum image age for this pass")
	fs.DurationVar(&maxAge, "image-maximum-gc-age", 0, "override the maximum image age for this pass (0s: disabled)")
	return cmd
}

func printGCResult(cmd *cobra.Command, res events.GCResult) error {
	w := cmd.OutOrStdout()
	mode := ""
	if res.DryRun {
		mode = " (dry run: nothing removed)"
	}
	if res.AllUnused {
		fmt.Fprintf(w, "node %s: delete unused images, %s eligible; image fs %d%% used of %s, %s available%s\n", res.Node,
			FormatSize(max(res.AmountToFree, 0)), res.UsagePercent, FormatSize(res.CapacityBytes), FormatSize(res.AvailableBytes), mode)
	} else {
		fmt.Fprintf(w, "node %s: image fs %d%% used of %s, %s available, to free %s%s\n", res.Node, res.UsagePercent,
			FormatSize(res.CapacityBytes), FormatSize(res.AvailableBytes), FormatSize(max(res.AmountToFree, 0)), mode)
	}
	if len(res.Policies) > 0 {
		fmt.Fprintf(w, "policy: ImageGCPolicy %s over the node's flags\n", events.GCPolicy{Sources: res.Policies}.Names())
	}
	verb := "freed"
	if res.DryRun {
		verb = "would free"
	}
	if res.DryRun {
		fmt.Fprintf(w, "would remove %d, %s %s (%d bytes) in %v\n", len(res.Succeeded()), verb, FormatSize(res.FreedBytes), res.FreedBytes, res.Duration.Duration.Round(time.Millisecond))
	} else {
		fmt.Fprintf(w, "removed %d, %d failed, %s %s (%d bytes) in %v\n", len(res.Succeeded()), res.FailedCount(), verb, FormatSize(res.FreedBytes), res.FreedBytes, res.Duration.Duration.Round(time.Millisecond))
		if res.MeasuredAvailableBytes > 0 {
			fmt.Fprintf(w, "measured on the image fs: %s given back, %s available\n", FormatSize(max(res.MeasuredFreedBytes, 0)), FormatSize(res.MeasuredAvailableBytes))
		}
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTAGS\tSIZE\tACTION\tWHY")
	for _, r := range res.Removed {
		action := "removed"
		switch {
		case r.Error != "":
			action = "failed"
		case res.DryRun:
			action = "would remove"
		}
		why := r.Reason
		if r.Error != "" {
			why += ": " + r.Error
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", shortID(r.ID), strings.Join(r.RepoTags, ","), FormatSize(r.Size), action, why)
	}
	for _, s := range res.Skipped {
		why := s.Why
		if s.Why == gc.WhyPinnedByGCPolicy {
			why += " " + s.Policy // the other reasons of a policy name it themselves
		}
		fmt.Fprintf(tw, "%s\t\t\tkept\t%s\n", shortID(s.ID), why)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if res.Error != "" {
		fmt.Fprintf(w, "error: %s\n", res.Error)
	}
	return nil
}
