package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

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
		Long: `Publish each pod of the files (YAML or JSON, "---" separates documents) as a pod event.
A pod without a namespace goes to "default". A pod without a UID takes the UID of the indexed pod of the same
namespace and name, or a new random UID. apply = added if the index does not have the pod, updated otherwise.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			if len(files) == 0 {
				return fmt.Errorf("-f FILE is required")
			}
			pods, err := readPodFiles(files)
			if err != nil {
				return err
			}
			return cl.publishPods(cmd, node, pods, "", false, wait)
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
			var pods []*v1.Pod
			if len(args) == 1 {
				ns, name, err := splitNSName(args[0])
				if err != nil {
					return err
				}
				pods = []*v1.Pod{{}}
				pods[0].Namespace, pods[0].Name = ns, name
			} else {
				var err error
				if pods, err = readPodFiles(files); err != nil {
					return err
				}
			}
			return cl.publishPods(cmd, node, pods, events.ActionDeleted, len(args) == 1, wait)
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
		if err := indexRequest(ctx, b, node, events.QryPods, q, &rep); err != nil {
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

// indexRequest asks the pod index's query what, again while the index answers that it is catching up with
// its events (after a restart: seconds), until ctx ends.
func indexRequest(ctx context.Context, b *bus.Bus, node, what string, q, rep any) error {
	for {
		err := b.Request(ctx, events.QuerySubject(node, what), q, rep)
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

// readPodFiles reads the pods of YAML or JSON files ("---" separates YAML documents).
func readPodFiles(files []string) ([]*v1.Pod, error) {
	var pods []*v1.Pod
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		for i, doc := range splitYAMLDocs(data) {
			js, err := yaml.YAMLToJSON(doc)
			if err != nil {
				return nil, fmt.Errorf("%s: document %d: %w", f, i+1, err)
			}
			if len(bytes.TrimSpace(js)) == 0 || string(bytes.TrimSpace(js)) == "null" {
				continue
			}
			p := &v1.Pod{}
			if err := json.Unmarshal(js, p); err != nil {
				return nil, fmt.Errorf("%s: document %d is not a pod: %w", f, i+1, err)
			}
			if p.Kind != "" && p.Kind != "Pod" {
				return nil, fmt.Errorf("%s: document %d is a %s, not a Pod", f, i+1, p.Kind)
			}
			if p.Name == "" {
				return nil, fmt.Errorf("%s: document %d: pod has no metadata.name", f, i+1)
			}
			if p.Namespace == "" {
				p.Namespace = "default"
			}
			pods = append(pods, p)
		}
	}
	if len(pods) == 0 {
		return nil, fmt.Errorf("no pods in %s", strings.Join(files, ", "))
	}
	return pods, nil
}

func splitYAMLDocs(data []byte) [][]byte {
	var docs [][]byte
	var cur []byte
	for _, line := range bytes.SplitAfter(data, []byte("\n")) {
		if t := bytes.TrimRight(line, " \t\r\n"); string(t) == "---" {
			docs = append(docs, cur)
			cur = nil
			continue
		}
		cur = append(cur, line...)
	}
	return append(docs, cur)
}

// publishPods resolves each pod against the index (apply: added or updated; delete: the indexed pod), then
// publishes the events and, with wait, waits until the index applied them.
func (cl *cli) publishPods(cmd *cobra.Command, node string, pods []*v1.Pod, action string, byName, wait bool) error {
	ctx := cmd.Context()
	b, err := cl.connect(ctx, "imagefleet-pods")
	if err != nil {
		return err
	}
	defer b.Close()
	rctx, cancel := cl.contextTimeout(ctx)
	defer cancel()
	indexUp := true
	var msgs []bus.RawMsg
	var results []podResult
	now := time.Now()
	for _, p := range pods {
		pod, mirror, err := lookupPod(rctx, b, node, p.Namespace, p.Name)
		if errors.Is(err, bus.ErrNoResponders) {
			indexUp, pod, mirror, err = false, nil, nil, nil
		}
		if err != nil {
			return err
		}
		// A mirror pod manifest is matched with the indexed mirror pod of its name, any other with the
		// indexed pod: a UID is never carried from one kind to the other. Deleting by NS/NAME (no manifest)
		// falls back to the mirror pod when the index has no pod of that name.
		existing := pod
		if podindex.IsMirrorPod(p) || (byName && pod == nil) {
			existing = mirror
		}
		act := action
		switch {
		case act == events.ActionDeleted:
			if existing == nil {
				if p.UID == "" {
					return fmt.Errorf("pod %s/%s is not in the index of %s and has no uid to delete", p.Namespace, p.Name, node)
				}
			} else if p.UID == "" || p.UID == existing.UID {
				p = existing
			}
		case existing != nil && (p.UID == "" || p.UID == existing.UID):
			p.UID, act = existing.UID, events.ActionUpdated
		default:
			if p.UID == "" {
				p.UID = types.UID(uuid.NewString())
			}
			act = events.ActionAdded
		}
		m, err := podindex.PodEventMsg(node, act, p, "", now)
		if err != nil {
			return err
		}
		msgs = append(msgs, m)
		results = append(results, podResult{Action: act, Namespace: p.Namespace, Name: p.Name, UID: string(p.UID)})
	}
	last, err := b.PublishMsgs(rctx, msgs)
	if err != nil {
		return err
	}
	if wait && indexUp {
		if err := waitApplied(rctx, b, node, last); err != nil {
			return err
		}
	}
	if cl.jsonOutput() {
		return printJSON(cmd.OutOrStdout(), results)
	}
	for _, r := range results {
		fmt.Fprintf(cmd.OutOrStdout(), "pod %s/%s %s (uid %s)\n", r.Namespace, r.Name, r.Action, r.UID)
	}
	if !indexUp {
		fmt.Fprintf(cmd.ErrOrStderr(), "the pod index of %s is not running; the events are stored and applied when it starts\n", node)
	}
	return nil
}

// lookupPod returns the indexed non-mirror pod and the indexed mirror pod named ns/name, each nil when the
// index does not have it.
func lookupPod(ctx context.Context, b *bus.Bus, node, ns, name string) (pod, mirror *v1.Pod, err error) {
	var rep events.PodsReply
	if err := indexRequest(ctx, b, node, events.QryPods, events.PodsQuery{Namespace: ns, Name: name}, &rep); err != nil {
		return nil, nil, fmt.Errorf("look up pod %s/%s on %s: %w", ns, name, node, err)
	}
	decode := func(raws []json.RawMessage) (*v1.Pod, error) {
		if len(raws) == 0 {
			return nil, nil
		}
		p := &v1.Pod{}
		if err := json.Unmarshal(raws[0], p); err != nil {
			return nil, fmt.Errorf("decode pod %s/%s: %w", ns, name, err)
		}
		return p, nil
	}
	if pod, err = decode(rep.Pods); err != nil {
		return nil, nil, err
	}
	if mirror, err = decode(rep.MirrorPods); err != nil {
		return nil, nil, err
	}
	return pod, mirror, nil
}

// waitApplied polls the index until it applied seq.
func waitApplied(ctx context.Context, b *bus.Bus, node string, seq uint64) error {
	for {
		var rep events.RefsReply
		err := b.Request(ctx, events.QuerySubject(node, events.QryRefs), nil, &rep)
		if err == nil && rep.AppliedSeq >= seq {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the pod index of %s to apply sequence %d: %w", node, seq, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
