package main

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func requireNode(node string) error {
	if node == "" {
		return fmt.Errorf("--node is required")
	}
	return events.ValidateNodeName(node)
}

func newDetectCmd(cl *cli) *cobra.Command {
	var node string
	cmd := &cobra.Command{
		Use:   "detect --node N",
		Short: "Detect images now and print the records",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-detect")
			if err != nil {
				return err
			}
			defer b.Close()
			rctx, cancel := cl.contextTimeout(ctx)
			defer cancel()
			var rep events.DetectReply
			if err := b.Request(rctx, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &rep); err != nil {
				return fmt.Errorf("detect on %s: %w", node, err)
			}
			if rep.Unpublished > 0 {
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: %d image events of %s not published yet (NATS did not take them; the detector retries them)\n", rep.Unpublished, node)
			}
			return cl.printRecords(cmd, b, node)
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	return cmd
}

func newRecordsCmd(cl *cli) *cobra.Command {
	var node string
	cmd := &cobra.Command{
		Use:   "records --node N",
		Short: "Print the image records: id, repoTags, size, firstDetected, lastUsed, inUse, pinned",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			b, err := cl.connect(cmd.Context(), "imagefleet-records")
			if err != nil {
				return err
			}
			defer b.Close()
			return cl.printRecords(cmd, b, node)
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	return cmd
}

// printRecords reads the records from the KV bucket (a node can have more than one message holds).
func (cl *cli) printRecords(cmd *cobra.Command, b *bus.Bus, node string) error {
	ctx, cancel := cl.contextTimeout(cmd.Context())
	defer cancel()
	// The records are in the node's JetStream domain: its leaf's when it has one (docs/operations.md).
	domain, err := fleet.NodeDomain(ctx, b, node)
	if err != nil {
		return err
	}
	nb, err := b.InDomain(domain)
	if err != nil {
		return err
	}
	st, err := records.OpenStore(ctx, nb, node)
	if err != nil {
		return err
	}
	m, err := st.Load(ctx)
	if err != nil {
		return err
	}
	recs := detector.SortRecords(m, 0)
	if cl.jsonOutput() {
		return printJSON(cmd.OutOrStdout(), recs)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTAGS\tSIZE\tFIRST DETECTED\tLAST USED\tIN USE\tPINNED")
	for _, r := range recs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%v\t%v\n", shortID(r.ID), strings.Join(r.RepoTags, ","), FormatSize(r.Size),
			fmtTime(r.FirstDetected), fmtTime(r.LastUsed), r.InUse, r.Pinned)
	}
	return tw.Flush()
}

func newImagesCmd(cl *cli) *cobra.Command {
	var node string
	var limit int
	cmd := &cobra.Command{
		Use:   "images --node N",
		Short: "Print the cached image list, size descending",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-images")
			if err != nil {
				return err
			}
			defer b.Close()
			rctx, cancel := cl.contextTimeout(ctx)
			defer cancel()
			var rep events.ImagesReply
			if err := b.Request(rctx, events.QuerySubject(node, events.QryImages), events.QueryRequest{Limit: limit}, &rep); err != nil {
				return fmt.Errorf("images of %s: %w", node, err)
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep.Images)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tTAGS\tSIZE")
			for _, im := range rep.Images {
				fmt.Fprintf(tw, "%s\t%s\t%s\n", shortID(im.ID), strings.Join(im.RepoTags, ","), FormatSize(im.Size))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many images (node status uses 50)")
	return cmd
}

func shortID(id string) string {
	if strings.HasPrefix(id, "sha256:") && len(id) > 19 {
		return id[7:19]
	}
	return id
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// FormatSize formats bytes like the kubelet's formatSize (B, KiB, MiB, GiB, TiB, one decimal).
func FormatSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	f := float64(n)
	units := []string{"KiB", "MiB", "GiB", "TiB"}
	i := -1
	for f >= unit && i < len(units)-1 {
		f /= unit
		i++
	}
	return fmt.Sprintf("%.1f %s", f, units[i])
}
