package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/yaml"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/podindex"
)

func newPodsCmd(cl *cli) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pods",
		Short: "Publish pod events to a node's pod index and read it",
	}
	cmd.AddCommand(newPodsApplyCmd(cl), newPodsDeleteCmd(cl), newPodsGetCmd(cl))
	return cmd
}

// podResult is one line of apply/delete output.
type podResult struct {
	Action    string `json:"action"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

func newPodsApplyCmd(cl *cli) *cobra.Command {
	var node string
	var files []string
	var wait bool
	cmd := &cobra.Command{
		Use:   "apply --node N -f FILE...",
		Short: "Publish pod.added (a new pod) or pod.updated (a pod the index has) for each pod in the files",
		Long: `Send each pod of the files (YAML or JSON; "---" separates YAML documents; a kind: List document's
items are pods) to the node's pod index, which stores it as a pod event. A pod without a namespace goes to
"default". The index decides, one request at a time: added if it does not have the pod, updated otherwise;
a pod without a UID takes the UID of the indexed pod of the same namespace and name (a mirror pod manifest:
of the indexed mirror pod), or a new random UID. Pods are checked as the static pod source checks manifests
(the kubelet's validation) first; a refused pod fails the command and nothing is stored.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			if len(files) == 0 {
				return fmt.Errorf("-f FILE is required")
			}
			raws, _, err := readPodFiles(files, true)
			if err != nil {
				return err
			}
			return cl.applyPods(cmd, node, raws, events.PodApply, false, wait)
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	cmd.Flags().StringArrayVarP(&files, "filename", "f", nil, "pod manifest (YAML or JSON); repeat for more")
	cmd.Flags().BoolVar(&wait, "wait", true, "wait until the pod index applied the events")
	return cmd
}

func newPodsDeleteCmd(cl *cli) *cobra.Command {
	var node string
	var files []string
	var wait bool
	cmd := &cobra.Command{
		Use:   "delete --node N (NS/NAME | -f FILE...)",
		Short: "Publish pod.deleted for a pod the index has (by namespace/name) or for the pods of the files",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			if (len(args) == 1) == (len(files) > 0) {
				return fmt.Errorf("give either NS/NAME or -f FILE")
			}
			var raws []json.RawMessage
			if len(args) == 1 {
				ns, name, err := splitNSName(args[0])
				if err != nil {
					return err
				}
				p := v1.Pod{}
				p.Namespace, p.Name = ns, name
				raw, err := json.Marshal(p)
				if err != nil {
					return err
				}
				raws = []json.RawMessage{raw}
			} else {
				var err error
				if raws, _, err = readPodFiles(files, false); err != nil {
					return err
				}
			}
			return cl.applyPods(cmd, node, raws, events.PodDelete, len(args) == 1, wait)
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	cmd.Flags().StringArrayVarP(&files, "filename", "f", nil, "pod manifest (YAML or JSON); repeat for more")
	cmd.Flags().BoolVar(&wait, "wait", true, "wait until the pod index applied the events")
	return cmd
}

func newPodsGetCmd(cl *cli) *cobra.Command {
	var node, uid, source string
	var orphaned bool
	var limit int
	cmd := &cobra.Command{
		Use:   "get --node N [NS/NAME | --uid UID | --orphaned | --source SOURCE]",
		Short: "Print the pods of a node's index (a mirror pod's UID finds its static pod)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			if limit < 0 {
				return fmt.Errorf("--limit %d must not be negative", limit)
			}
			q := events.PodsQuery{UID: uid, Orphaned: orphaned, Source: source}
			if len(args) == 1 {
				var err error
				if q.Namespace, q.Name, err = splitNSName(args[0]); err != nil {
					return err
				}
			}
			if err := q.Validate(); err != nil {
				return err
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-pods")
			if err != nil {
				return err
			}
			defer b.Close()
			rctx, cancel := cl.contextTimeout(ctx)
			defer cancel()
			rep, err := listPods(rctx, b, node, q, limit)
			if err != nil {
				return fmt.Errorf("pods of %s: %w", node, err)
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			if (q.UID != "" || q.Name != "") && len(rep.Pods)+len(rep.MirrorPods) == 0 {
				return fmt.Errorf("pod not found in the index of %s", node)
			}
			return printPods(cmd, rep)
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "node name")
	cmd.Flags().StringVar(&uid, "uid", "", "pod UID (a mirror pod UID is translated to its static pod)")
	cmd.Flags().BoolVar(&orphaned, "orphaned", false, "only the orphaned mirror pods")
	cmd.Flags().StringVar(&source, "source", "", `only the pods of this kubernetes.io/config.source ("file": static pods)`)
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many pods and mirror pods (0: all)")
	return cmd
}

// listPods asks the pods query page after page (a reply carries at most events.MaxPodsPageBytes of pods)
// until the listing ends or limit entries (0: no limit) were read, and returns them as one reply, with the
// translations, orphans and stale mirror pods of its last page (the newest).
func listPods(ctx context.Context, b *bus.Bus, node string, q events.PodsQuery, limit int) (events.PodsReply, error) {
	var pods, mirrors []json.RawMessage
	for {
		if limit > 0 && q.UID == "" && q.Name == "" {
			q.Limit = limit - (len(pods) + len(mirrors))
		}
		var rep events.PodsReply
		if err := indexRequest(ctx, b, events.QuerySubject(node, events.QryPods), q, &rep); err != nil {
			return events.PodsReply{}, err
		}
		pods, mirrors = append(pods, rep.Pods...), append(mirrors, rep.MirrorPods...)
		if !rep.Truncated || (limit > 0 && len(pods)+len(mirrors) >= limit) {
			rep.Pods, rep.MirrorPods = pods, mirrors
			return rep, nil
		}
		q.After = rep.Next
	}
}

// indexRequest asks the pod index (a query or podapply), again while the index answers that it is catching up with
// its events (after a restart: seconds), until ctx ends.
func indexRequest(ctx context.Context, b *bus.Bus, subject string, q, rep any) error {
	for {
		err := b.Request(ctx, subject, q, rep)
		if !podindex.IsCatchingUp(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func printPods(cmd *cobra.Command, rep events.PodsReply) error {
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tNAME\tUID\tKIND\tPHASE\tMIRROR/STATIC UID")
	row := func(raw json.RawMessage, mirror bool) error {
		var p v1.Pod
		if err := json.Unmarshal(raw, &p); err != nil {
			return fmt.Errorf("decode pod: %w", err)
		}
		kind, other := "pod", ""
		switch {
		case mirror:
			kind, other = "mirror", rep.MirrorToPod[string(p.UID)]
			if slices.Contains(rep.StaleMirrorPods, string(p.UID)) {
				kind = "mirror (stale)" // not the mirror of the static pod's current manifest
			}
		case podindex.IsStaticPod(&p):
			kind, other = "static", rep.PodToMirror[string(p.UID)]
		}
		if other == "" {
			other = "-"
		}
		phase := string(p.Status.Phase)
		if phase == "" {
			phase = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", p.Namespace, p.Name, p.UID, kind, phase, other)
		return nil
	}
	for _, raw := range rep.Pods {
		if err := row(raw, false); err != nil {
			return err
		}
	}
	for _, raw := range rep.MirrorPods {
		if err := row(raw, true); err != nil {
			return err
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rep.OrphanedMirrorPods) > 0 {
		fmt.Fprintf(cmd.OutOrStdout(), "orphaned mirror pods: %s\n", strings.Join(rep.OrphanedMirrorPods, ", "))
	}
	if rep.Truncated {
		fmt.Fprintf(cmd.OutOrStdout(), "(%d pods in the index; listing truncated by --limit)\n", rep.Total)
	}
	return nil
}

func splitNSName(s string) (string, string, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return "", "", fmt.Errorf("pod %q: want NAMESPACE/NAME", s)
	}
	return ns, name, nil
}

// manifestDoc is what a manifest document is read as first: a Pod, or a List of them (as `kubectl get pods
// -o yaml` prints).
type manifestDoc struct {
	Kind       string            `json:"kind"`
	APIVersion string            `json:"apiVersion"`
	Items      []json.RawMessage `json:"items"`
}

// readPodFiles reads the pods of YAML or JSON files with apimachinery's decoder: multi-document YAML
// ("---" separators, comments after them), a stream of JSON objects, and `kind: List` documents whose items
// are pods. Each pod is decoded as the index decodes it; for apply (check), it is also checked as the index
// checks it, so a refused pod is reported before anything is sent.
func readPodFiles(files []string, check bool) ([]json.RawMessage, []*v1.Pod, error) {
	var raws []json.RawMessage
	var pods []*v1.Pod
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			return nil, nil, err
		}
		dec := yaml.NewYAMLOrJSONDecoder(fh, 4096)
		for i := 1; ; i++ {
			var doc json.RawMessage
			err := dec.Decode(&doc)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				_ = fh.Close()
				return nil, nil, fmt.Errorf("%s: document %d: %w", f, i, err)
			}
			if t := bytes.TrimSpace(doc); len(t) == 0 || string(t) == "null" {
				continue
			}
			var head manifestDoc
			if err := json.Unmarshal(doc, &head); err != nil {
				_ = fh.Close()
				return nil, nil, fmt.Errorf("%s: document %d is not a pod: %w", f, i, err)
			}
			items := []json.RawMessage{doc}
			if head.Kind == "List" && (head.APIVersion == "v1" || head.APIVersion == "") {
				items = head.Items
			}
			for k, item := range items {
				where := fmt.Sprintf("%s: document %d", f, i)
				if head.Kind == "List" {
					where += fmt.Sprintf(", item %d", k+1)
				}
				p, err := podindex.DecodePod(item)
				if err != nil {
					_ = fh.Close()
					return nil, nil, fmt.Errorf("%s: %w", where, err)
				}
				if check {
					if err := podindex.ValidatePod(p); err != nil {
						_ = fh.Close()
						return nil, nil, fmt.Errorf("%s: %w", where, err)
					}
				}
				raws, pods = append(raws, item), append(pods, p)
			}
		}
		_ = fh.Close()
	}
	if len(pods) == 0 {
		return nil, nil, fmt.Errorf("no pods in %s", strings.Join(files, ", "))
	}
	return raws, pods, nil
}

// noIndexGrace is how long apply and delete ask again when no pod index answers (an agent starting).
const noIndexGrace = 2 * time.Second

// applyBatchBytes bounds the pods of one podapply request (the server's max payload is 1 MiB by default).
const applyBatchBytes = 512 << 10

// applyPods sends the pods to the node's pod index in requests of at most applyBatchBytes: the index decides
// each pod's event (added, updated, deleted), its UID and whether it is a mirror pod, stores the events and,
// with wait, answers once it applied them. It prints what the index did.
func (cl *cli) applyPods(cmd *cobra.Command, node string, raws []json.RawMessage, op string, byName, wait bool) error {
	ctx := cmd.Context()
	b, err := cl.connect(ctx, "imagefleet-pods")
	if err != nil {
		return err
	}
	defer b.Close()
	rctx, cancel := cl.contextTimeout(ctx)
	defer cancel()
	var results []events.PodApplyResult
	for len(raws) > 0 {
		n, size := 0, 0
		for n < len(raws) && (n == 0 || size+len(raws[n]) <= applyBatchBytes) {
			size += len(raws[n])
			n++
		}
		req := events.PodApplyRequest{Op: op, Pods: raws[:n], ByName: byName, Wait: wait && n == len(raws)}
		var rep events.PodApplyReply
		err := indexRequest(rctx, b, events.CommandSubject(node, events.VerbPodApply), req, &rep)
		// An agent that has just started may not serve podapply yet: ask again for a moment.
		for start := time.Now(); errors.Is(err, bus.ErrNoResponders) && time.Since(start) < noIndexGrace && rctx.Err() == nil; {
			time.Sleep(100 * time.Millisecond)
			err = indexRequest(rctx, b, events.CommandSubject(node, events.VerbPodApply), req, &rep)
		}
		if err != nil {
			if errors.Is(err, bus.ErrNoResponders) {
				return fmt.Errorf("no pod index answers on %s: it decides what each pod is, so nothing was sent (run the agent's podindex worker)", node)
			}
			return fmt.Errorf("pods on %s: %w", node, err)
		}
		results = append(results, rep.Results...)
		raws = raws[n:]
	}
	if cl.jsonOutput() {
		out := make([]podResult, len(results))
		for i, r := range results {
			out[i] = podResult{Action: r.Action, Namespace: r.Namespace, Name: r.Name, UID: r.UID}
		}
		return printJSON(cmd.OutOrStdout(), out)
	}
	for _, r := range results {
		fmt.Fprintf(cmd.OutOrStdout(), "pod %s/%s %s (uid %s)\n", r.Namespace, r.Name, r.Action, r.UID)
	}
	return nil
}
