package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

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

// printContinue tells on stderr how to get the next page (stdout keeps only the table).
func printContinue(cmd *cobra.Command, token string) {
	if token != "" {
		fmt.Fprintf(cmd.ErrOrStderr(), "more follow: --continue %s\n", token)
	}
}

// inventoryQuery adds the page flags to q.
func (f *pageFlags) inventoryQuery(q events.InventoryQuery) (events.InventoryQuery, error) {
	if f.limit < 0 {
		return q, fmt.Errorf("--limit %d must not be negative", f.limit)
	}
	q.Limit, q.Continue = f.limit, f.cont
	return q, nil
}
