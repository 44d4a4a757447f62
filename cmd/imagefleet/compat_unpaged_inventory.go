// Compatibility path: an inventory replica that does not page (no `continue`).
//
// A replica of the layout before paged inventory queries caps its answer at Limit, sets no Continue, and
// refuses a query that sets Continue (an unknown field). fleet images|where fetch a whole answer in chunks
// of inventoryChunk; such a replica answers the first chunk alone, without Continue, so the CLI warns that
// the answer is short (warnUnpaged) instead of showing it as whole.
//
// Remove when: no unpaged replica runs (docs/upgrading.md, "Compatibility paths").

package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
)

// warnUnpaged warns on cmd's standard error when the first answer to q, all, holds fewer entries than its
// Total without a Continue to fetch the rest: a replica that does not page answered.
func warnUnpaged(cmd *cobra.Command, q events.InventoryQuery, all events.InventoryReply) {
	if n := len(all.Images) + len(all.Placements) + len(all.Nodes); q.Continue == "" && all.Continue == "" && n < all.Total {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: the inventory answered %d of %d (a replica of an earlier release does not page: upgrade it)\n", n, all.Total)
	}
}
