// Compatibility path: the single pull queue IMAGEFLEET_PULL (events.PullStream).
//
// Agents and commands still create the single pull queue of the layout before the partitioned one
// (bus/compat_single_queue.go), so that CLIs and orchestrators of that layout can queue pulls during a rolling
// upgrade. `imagefleet bus streams --pull` lists it with the partitions (isLegacyPullQueue), so an operator
// checks that it is empty, and `imagefleet bus remove-legacy-pull` removes it (docs/upgrading.md, "The
// partitioned pull queue").
//
// Remove when: no supported release publishes to the single queue (the release after the partitioned
// queue's next; docs/upgrading.md, "Compatibility paths").

package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// isLegacyPullQueue reports whether stream name is the single pull queue.
func isLegacyPullQueue(name string) bool { return name == events.PullStream }

// newBusRemoveLegacyPullCmd is `imagefleet bus remove-legacy-pull`: the single queue's removal, the last step
// of the upgrade to the partitioned queue.
func newBusRemoveLegacyPullCmd(cl *cli) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "remove-legacy-pull [--force]",
		Short: "Remove the legacy pull queue IMAGEFLEET_PULL and its consumers, once it is empty (after an upgrade)",
		Long: `Remove the single pull work queue of releases before the partitioned one, with the node consumers on it,
after every agent, CLI and orchestrator runs this release (docs/operations.md). Refused while it holds
messages (requests of an old CLI not run yet), unless --force. Run it with the admin identity. Agents and
commands of this release create the stream again, empty and without consumers, until a later release
stops creating it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			b, err := cl.connect(ctx, "imagefleet-bus-remove-legacy-pull")
			if err != nil {
				return err
			}
			defer b.Close()
			st, err := b.Stream(ctx, events.PullStream)
			if bus.IsStreamNotFound(err) {
				fmt.Fprintf(cmd.OutOrStdout(), "%s does not exist\n", events.PullStream)
				return nil
			}
			if err != nil {
				return err
			}
			if st.Messages > 0 && !force {
				return fmt.Errorf("%s holds %d pull requests not run yet (agents of this release drain them; "+
					"an old agent runs its own): wait, or --force to drop them", events.PullStream, st.Messages)
			}
			if err := b.DeleteStream(ctx, events.PullStream); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "removed %s (%d messages, %d consumers)\n", events.PullStream, st.Messages, st.Consumers)
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "remove even while it holds pull requests (they are lost)")
	return cmd
}
