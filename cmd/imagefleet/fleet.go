package main

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
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

func newFleetImagesCmd(cl *cli) *cobra.Command {
	var pf pageFlags
	cmd := &cobra.Command{
		Use:   "images [--limit N [--continue TOKEN]]",
		Short: "Every image in the fleet: on how many nodes, and the bytes it takes in all (from the inventory)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return cl.printInventory(cmd, pf, events.InventoryQuery{What: events.InventoryImages},
				"ID\tTAGS\tSIZE\tNODES\tTOTAL\tLAST USED", func(tw io.Writer, rep events.InventoryReply) {
					for _, im := range rep.Images {
						fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", shortID(im.ID), strings.Join(im.RepoTags, ","), FormatSize(im.Size),
							im.Nodes, FormatSize(im.TotalBytes), fmtTime(im.LastUsed))
					}
					fmt.Fprintf(tw, "%d images\t\t\t\t%s\t\n", rep.Total, FormatSize(rep.TotalBytes))
				})
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
			return cl.printInventory(cmd, pf, events.InventoryQuery{What: events.InventoryWhere, Image: args[0]},
				"NODE\tID\tTAGS\tSIZE\tIN USE\tLAST USED", func(tw io.Writer, rep events.InventoryReply) {
					for _, p := range rep.Placements {
						fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%s\n", p.Node, shortID(p.ID), strings.Join(p.RepoTags, ","), FormatSize(p.Size), p.InUse, fmtTime(p.LastUsed))
					}
					fmt.Fprintf(tw, "%d nodes\t\t\t%s\t\t\n", rep.Total, FormatSize(rep.TotalBytes))
				})
		},
	}
	pf.register(cmd, false)
	return cmd
}

func newFleetGCCmd(cl *cli) *cobra.Command {
	var f rolloutFlags
	var o objectFlags
	var dryRun, allUnused bool
	var images []string
	cmd := &cobra.Command{
		Use:   "gc [--selector k=v] [--initial-batch 1] [--max-failures 0|N|P%] [--dry-run] [--all-unused | --images REF,...] [--node-timeout 60s] [--object NAME]",
		Short: "Run image GC on the chosen nodes in slow-start batches (1, 2, 4 ...), stopping after a batch takes the failures past --max-failures",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if allUnused && len(images) > 0 {
				return errors.New("--all-unused and --images exclude each other")
			}
			if o.name != "" {
				spec, err := f.spec(cmd)
				if err != nil {
					return err
				}
				gc := &v1alpha1.ImageGC{Spec: v1alpha1.ImageGCSpec{DryRun: dryRun, Images: images, RolloutSpec: spec}}
				if allUnused {
					gc.Spec.Mode = "AllUnused"
				}
				return cl.createObject(cmd, o, gc)
			}
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
			req := events.GCRequest{ID: cfg.ID, DryRun: dryRun, AllUnused: allUnused, Images: images}
			if err := req.Validate(); err != nil {
				return err
			}
			cfg.DryRun, cfg.GC = dryRun, &req
			err = cl.runRollout(cmd, b, cfg, fleet.GCAction(b, req))
			return errors.Join(err, writeMemProfile(f.memProfile))
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what GC would remove on each node and the bytes it would free; remove nothing")
	cmd.Flags().BoolVar(&allUnused, "all-unused", false, "remove every eligible unused image (DeleteUnusedImages), not just down to the low threshold")
	cmd.Flags().StringSliceVar(&images, "images", nil, "remove these images (references, IDs, digests or globs) from every node where no container uses them, however young (docs/gc.md, named images)")
	o.register(cmd)
	return cmd
}

func newFleetPullCmd(cl *cli) *cobra.Command {
	var f rolloutFlags
	var o objectFlags
	var policy string
	var allowPrivate bool
	cmd := &cobra.Command{
		Use:   "pull IMAGE [--selector k=v] [--initial-batch 1] [--max-failures 0|N|P%] [--object NAME]",
		Short: "Pre-pull an image on the chosen nodes in slow-start batches",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.name != "" {
				spec, err := f.spec(cmd)
				if err != nil {
					return err
				}
				if policy == events.PullNever {
					return errors.New("--policy Never and --object exclude each other: an ImagePrePull pulls IfNotPresent or Always")
				}
				return cl.createObject(cmd, o, &v1alpha1.ImagePrePull{Spec: v1alpha1.ImagePrePullSpec{Images: []string{args[0]},
					PullPolicy: policy, AllowPrivate: allowPrivate, RolloutSpec: spec}})
			}
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
	o.register(cmd)
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
				started, err := fleet.LoadRolloutStarted(sctx, b, id)
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
