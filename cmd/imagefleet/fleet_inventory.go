package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// inventoryChunk is the page size in which fleet images|where fetch a whole answer when no --limit is given:
// one reply stays far under NATS's 1 MiB max payload (a where of an image on 10,000 nodes is ~3 MB).
const inventoryChunk = 1000

// inventoryQuery asks the inventory. With q.Limit set, one page; without, every page after q.Continue in
// chunks, joined into one answer.
func (cl *cli) inventoryQuery(cmd *cobra.Command, q events.InventoryQuery) (events.InventoryReply, error) {
	ctx, cancel := cl.contextTimeout(cmd.Context())
	defer cancel()
	b, err := cl.connect(ctx, "imagefleet-fleet-inventory")
	if err != nil {
		return events.InventoryReply{}, err
	}
	defer b.Close()
	if q.Limit > 0 {
		return askInventory(ctx, b, q)
	}
	q.Limit = inventoryChunk
	all, err := askInventory(ctx, b, q)
	if err != nil {
		return all, err
	}
	warnUnpaged(cmd, q, all) // compat_unpaged_inventory.go
	for next := all.Continue; next != ""; {
		q.Continue = next
		rep, err := askInventory(ctx, b, q)
		if err != nil {
			return all, err
		}
		all.Images = append(all.Images, rep.Images...)
		all.Placements = append(all.Placements, rep.Placements...)
		all.Nodes = append(all.Nodes, rep.Nodes...)
		next = rep.Continue
	}
	all.Continue = ""
	return all, nil
}

// askInventory sends one inventory query. A partitioned inventory whose partitions are being taken over
// answers events.ErrPartsMissing for seconds: the query is sent again, once a second, up to 5 times.
func askInventory(ctx context.Context, b *bus.Bus, q events.InventoryQuery) (events.InventoryReply, error) {
	for attempt := 1; ; attempt++ {
		var rep events.InventoryReply
		err := b.Request(ctx, events.InventoryQuerySubject, q, &rep)
		if err == nil {
			return rep, nil
		}
		if !errors.Is(err, events.ErrPartsMissing) || attempt == 5 {
			return rep, fmt.Errorf("fleet inventory: %w", err)
		}
		select {
		case <-ctx.Done():
			return rep, fmt.Errorf("fleet inventory: %w", err)
		case <-time.After(time.Second):
		}
	}
}

// printInventory asks the inventory q with the page flags and prints the reply: JSON with -o json, else a
// table of header and the rows rows writes, then the next page's token when there is one.
func (cl *cli) printInventory(cmd *cobra.Command, pf pageFlags, q events.InventoryQuery, header string, rows func(io.Writer, events.InventoryReply)) error {
	q, err := pf.inventoryQuery(q)
	if err != nil {
		return err
	}
	rep, err := cl.inventoryQuery(cmd, q)
	if err != nil {
		return err
	}
	if cl.jsonOutput() {
		return printJSON(cmd.OutOrStdout(), rep)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	rows(tw, rep)
	if err := tw.Flush(); err != nil {
		return err
	}
	printContinue(cmd, rep.Continue)
	return nil
}
