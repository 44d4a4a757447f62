package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/tail"
)

type eventsFlags struct {
	node    string
	follow  bool
	tail    int64
	typ     string
	journal string
}

func newEventsCmd(cl *cli) *cobra.Command {
	var f eventsFlags
	cmd := &cobra.Command{
		Use:   "events [--node N] [--follow] [--tail N] [--type T] [--journal FILE]",
		Short: "Print events from the events stream (or a node's local journal file)",
		Long: `Print events, one line each (time, node, type, reason, message), or JSON lines with -o json.
--type takes a type (imagefleet.image.removed.v1), entity.action (image.removed) or an entity (image).
--journal FILE reads an agent's local journal (<data-dir>/journal/events.jsonl) instead of NATS; with --tail N
it reads only the end of the file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return cl.runEvents(cmd, f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.node, "node", "", "only this node's events")
	fs.BoolVarP(&f.follow, "follow", "f", false, "keep printing new events until interrupted")
	fs.Int64Var(&f.tail, "tail", -1, "print only the last N events (-1: all)")
	fs.StringVar(&f.typ, "type", "", "only events of this type")
	fs.StringVar(&f.journal, "journal", "", "read this journal file instead of the events stream")
	return cmd
}

// eventFilter is the subject filter and the matcher of the flags.
type eventFilter struct {
	node, entity, action, version string
}

func parseEventFilter(node, typ string) (eventFilter, error) {
	var ef eventFilter
	if node != "" {
		if err := events.ValidateNodeName(node); err != nil {
			return ef, err
		}
		ef.node = node
	}
	if typ == "" {
		return ef, nil
	}
	if strings.HasPrefix(typ, events.Prefix+".") {
		e, a, v, err := events.ParseType(typ)
		if err != nil {
			return ef, err
		}
		ef.entity, ef.action, ef.version = e, a, v
		return ef, nil
	}
	parts := strings.Split(typ, ".")
	if len(parts) > 2 || parts[0] == "" || (len(parts) == 2 && parts[1] == "") || strings.ContainsAny(typ, "*> ") {
		return ef, fmt.Errorf("type %q: want a type (imagefleet.image.removed.v1), entity.action or an entity", typ)
	}
	ef.entity = parts[0]
	if len(parts) == 2 {
		ef.action = parts[1]
	}
	return ef, nil
}

// subject is the stream subject filter.
func (ef eventFilter) subject() string {
	node := "*"
	if ef.node != "" {
		node = events.NodeToken(ef.node)
	}
	s := events.Prefix + ".evt." + node
	switch {
	case ef.entity == "":
		return s + ".>"
	case ef.action == "":
		return s + "." + ef.entity + ".>"
	default:
		return s + "." + ef.entity + "." + ef.action
	}
}

func (ef eventFilter) match(ev events.Event) bool {
	if ef.node != "" && ev.Node != ef.node {
		return false
	}
	if ef.entity == "" {
		return true
	}
	e, a, v, err := events.ParseType(ev.Type)
	if err != nil {
		return false
	}
	return e == ef.entity && (ef.action == "" || a == ef.action) && (ef.version == "" || v == ef.version)
}

func (cl *cli) runEvents(cmd *cobra.Command, f eventsFlags) error {
	ef, err := parseEventFilter(f.node, f.typ)
	if err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	if f.journal != "" {
		if f.follow {
			return fmt.Errorf("--follow reads the events stream; it cannot be used with --journal")
		}
		return cl.printJournal(out, f.journal, f.tail, ef)
	}
	ctx := cmd.Context()
	b, err := cl.connect(ctx, "imagefleet-events")
	if err != nil {
		return err
	}
	defer b.Close()
	var last uint64
	if f.tail != 0 {
		var ring []events.Event
		rctx, cancel := cl.contextTimeout(ctx)
		err := b.Read(rctx, events.EventsStream, ef.subject(), func(m bus.StreamMsg) error {
			last = m.Seq
			ev, err := streamEvent(m)
			if err != nil || !ef.match(ev) {
				return nil
			}
			ring = append(ring, ev)
			if f.tail > 0 && int64(len(ring)) > f.tail {
				ring = ring[1:]
			}
			return nil
		})
		cancel()
		if err != nil {
			return err
		}
		for _, ev := range ring {
			if err := cl.printEvent(out, ev); err != nil {
				return err
			}
		}
	} else if f.follow {
		info, err := b.Stream(ctx, events.EventsStream)
		if err != nil {
			return err
		}
		last = info.LastSeq
	}
	if !f.follow {
		return nil
	}
	err = b.Read(ctx, events.EventsStream, ef.subject(), func(m bus.StreamMsg) error {
		if ev, err := streamEvent(m); err == nil && ef.match(ev) {
			if cl.printEvent(out, ev) != nil {
				return bus.StopReading
			}
		}
		return nil
	}, bus.Follow(), bus.From(last+1), bus.RetryFor(20*time.Second))
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// streamEvent is the event of a stream message: an event envelope, or a pod event, whose body is the Pod
// itself (the binary mode of CloudEvents: type, id, source and time in the ce- headers), shown as an event
// about that pod with the Pod as its data.
func streamEvent(m bus.StreamMsg) (events.Event, error) {
	ev, err := events.DecodeEventMsg(m.Header, m.Data)
	if err == nil || m.Header.Get(events.HeaderType) == "" {
		return ev, err
	}
	entity, _, _, perr := events.ParseType(m.Header.Get(events.HeaderType))
	if perr != nil || entity != events.EntityPod {
		return events.Event{}, err
	}
	pe, perr := events.DecodePodEvent(m.Subject, m.Header, m.Data)
	if perr != nil {
		return events.Event{}, fmt.Errorf("pod event %d: %w", m.Seq, perr)
	}
	at, terr := time.Parse(time.RFC3339Nano, m.Header.Get(events.HeaderTime))
	if terr != nil {
		at = m.Time
	}
	p := pe.Pod
	return events.Event{Type: m.Header.Get(events.HeaderType), ID: pe.ID, Time: at,
		Node:    strings.TrimPrefix(m.Header.Get(events.HeaderSource), events.SourcePrefix),
		Message: fmt.Sprintf("pod %s/%s (uid %s) %s", p.Namespace, p.Name, p.UID, pe.Action), Data: m.Data,
		Object: &events.ObjectRef{Kind: "Pod", Namespace: p.Namespace, Name: p.Name, UID: string(p.UID)}}, nil
}

// printJournal prints the last n events of a journal file (n < 0: all), reading only the end of the file
// (tail.FindTailLineStartIndex). With a filter, n counts matching events: it reads further back until it has
// n of them or reaches the start.
func (cl *cli) printJournal(out io.Writer, path string, n int64, ef eventFilter) error {
	var lines [][]byte
	if n < 0 {
		n = 1 << 62
	}
	for want := max(n, 1); n > 0; want *= 4 {
		all, err := tail.Lines(path, want)
		if err != nil {
			return fmt.Errorf("read journal: %w", err)
		}
		lines = lines[:0]
		for _, l := range all {
			if ev, err := events.DecodeEvent(l); err == nil && ef.match(ev) {
				lines = append(lines, l)
			}
		}
		if int64(len(lines)) >= n || int64(len(all)) < want {
			break
		}
	}
	if int64(len(lines)) > n {
		lines = lines[int64(len(lines))-n:]
	}
	w := bufio.NewWriter(out)
	for _, l := range lines {
		ev, _ := events.DecodeEvent(l)
		if err := cl.printEvent(w, ev); err != nil {
			return err
		}
	}
	return w.Flush()
}

// printEvent writes one line: the event as JSON with -o json, else time, node, type, reason, message.
func (cl *cli) printEvent(w io.Writer, ev events.Event) error {
	if cl.jsonOutput() {
		raw, err := json.Marshal(ev)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", raw)
		return err
	}
	reason, msg := ev.Reason, ev.Message
	if reason == "" {
		reason = "-"
	}
	_, err := fmt.Fprintf(w, "%s  %s  %s  %s  %s\n", ev.Time.UTC().Format(time.RFC3339), ev.Node, ev.Type, reason, oneLine(msg))
	return err
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
