package main

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
)

// streamRow is one stream in `imagefleet bus streams -o json`.
type streamRow struct {
	Name         string `json:"name"`
	Messages     uint64 `json:"messages"`
	Bytes        uint64 `json:"bytes"`
	Consumers    int    `json:"consumers"`
	MaxConsumers int    `json:"maxConsumers"`
	Replicas     int    `json:"replicas"`
	Leader       string `json:"leader,omitempty"`
}

// isPullQueue reports whether stream name is a pull work queue: a partition, or the single queue of the
// older layout (compat_single_queue.go).
func isPullQueue(name string) bool {
	return isLegacyPullQueue(name) || strings.HasPrefix(name, events.PullPartitionStreamPrefix)
}

func newBusStreamsCmd(cl *cli) *cobra.Command {
	var pullOnly bool
	cmd := &cobra.Command{
		Use:   "streams [--pull]",
		Short: "List the streams with their messages and consumers (--pull: the pull work queues only)",
		Long: `List every stream of the account with its messages, bytes, consumers, consumer limit (-1: the server's
default) and replicas. With --pull only the pull work queues: the partitions IMAGEFLEET_PULL_00 .. _15 and
the legacy IMAGEFLEET_PULL, whose MESSAGES must be 0 before it is removed after an upgrade
(docs/operations.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			b, err := cl.connect(ctx, "imagefleet-bus-streams")
			if err != nil {
				return err
			}
			defer b.Close()
			names, err := b.StreamNames(ctx)
			if err != nil {
				return err
			}
			slices.Sort(names)
			var rows []streamRow
			for _, n := range names {
				if pullOnly && !isPullQueue(n) {
					continue
				}
				st, err := b.Stream(ctx, n)
				if err != nil {
					return err
				}
				rows = append(rows, streamRow{Name: n, Messages: st.Messages, Bytes: st.Bytes, Consumers: st.Consumers,
					MaxConsumers: st.MaxConsumers, Replicas: st.Replicas, Leader: st.Leader})
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rows)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "STREAM\tMESSAGES\tBYTES\tCONSUMERS\tMAX CONSUMERS\tREPLICAS")
			for _, r := range rows {
				fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\n", r.Name, r.Messages, r.Bytes, r.Consumers, r.MaxConsumers, r.Replicas)
			}
			return w.Flush()
		},
	}
	cmd.Flags().BoolVar(&pullOnly, "pull", false, "only the pull work queues (partitions and the legacy queue)")
	return cmd
}
