package main

import (
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
)

func newRefsCmd(cl *cli) *cobra.Command {
	var node string
	cmd := &cobra.Command{
		Use:   "refs --node N",
		Short: "Print the registered secrets and configmaps with their reference counts",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-refs")
			if err != nil {
				return err
			}
			defer b.Close()
			rctx, cancel := cl.contextTimeout(ctx)
			defer cancel()
			var rep events.RefsReply
			if err := indexRequest(rctx, b, events.QuerySubject(node, events.QryRefs), nil, &rep); err != nil {
				return fmt.Errorf("refs of %s: %w", node, err)
			}
			if rep.Refs == nil {
				rep.Refs = []events.Ref{}
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep.Refs)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "KIND\tNAMESPACE\tNAME\tCOUNT")
			for _, r := range rep.Refs {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", r.Kind, r.Namespace, r.Name, r.Count)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	return cmd
}
