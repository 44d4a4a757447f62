package main

import (
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

func newDeadLettersCmd(cl *cli) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "deadletters [list|replay SEQ]",
		Short: "List dead letters (messages terminated or out of deliveries) and replay one to its original subject",
		Args:  cobra.NoArgs,
	}
	var consumer string
	list := &cobra.Command{
		Use:   "list [--consumer NAME]",
		Short: "List dead letters: seq, time, consumer, subject, deliveries, reason",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			b, err := cl.connect(ctx, "imagefleet-deadletters")
			if err != nil {
				return err
			}
			defer b.Close()
			filter := ""
			if consumer != "" {
				filter = events.DeadLetterPrefix + ".*." + consumer
			}
			dls, err := b.DeadLetters(ctx, filter)
			if err != nil {
				return err
			}
			if cl.jsonOutput() {
				if dls == nil {
					dls = []bus.DeadLetter{}
				}
				return printJSON(cmd.OutOrStdout(), dls)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "SEQ\tTIME\tCONSUMER\tSUBJECT\tDELIVERIES\tREASON")
			for _, d := range dls {
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\n", d.Seq, d.Time.UTC().Format(time.RFC3339),
					strings.TrimPrefix(d.Consumer, events.DeadLetterPrefix+"."), d.Subject, d.Deliveries, oneLine(d.Reason))
			}
			return w.Flush()
		},
	}
	list.Flags().StringVar(&consumer, "consumer", "", "only dead letters of this durable consumer")
	var remove bool
	replay := &cobra.Command{
		Use:   "replay SEQ",
		Short: "Publish dead letter SEQ again to its original subject (with its headers); --remove deletes it after",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			seq, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || seq == 0 {
				return fmt.Errorf("dead letter sequence %q: want a positive number (see deadletters list)", args[0])
			}
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			b, err := cl.connect(ctx, "imagefleet-deadletters")
			if err != nil {
				return err
			}
			defer b.Close()
			rep, err := b.ReplayDeadLetter(ctx, seq, remove)
			if err != nil {
				return err
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			switch {
			case rep.Duplicate:
				fmt.Fprintf(cmd.OutOrStdout(), "dead letter %d was replayed already to %s (stream %s seq %d)\n", seq, rep.Subject, rep.Stream, rep.Seq)
			case rep.Stream != "":
				fmt.Fprintf(cmd.OutOrStdout(), "dead letter %d replayed to %s (stream %s seq %d)\n", seq, rep.Subject, rep.Stream, rep.Seq)
			default:
				fmt.Fprintf(cmd.OutOrStdout(), "dead letter %d replayed to %s\n", seq, rep.Subject)
			}
			return nil
		},
	}
	replay.Flags().BoolVar(&remove, "remove", false, "delete the dead letter after replaying it")
	cmd.AddCommand(list, replay)
	return cmd
}
