package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/puller"
)

// pullOutput is what `pull -o json` prints: the result (imageRef; error and message on failure) with the
// request's identity.
type pullOutput struct {
	Node   string `json:"node"`
	Queued bool   `json:"queued"`
	events.PullResult
	// Reason is the kubelet event reason of the outcome (Pulled, Failed, BackOff, ...).
	Reason string `json:"reason,omitempty"`
}

func newPullCmd(cl *cli) *cobra.Command {
	var (
		node, policy, pod, requestID string
		secrets                      []string
		wait, allowPrivate           bool
		waitTimeout                  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "pull --node N IMAGE",
		Short: "Queue an image pull on a node (--wait: wait for its result)",
		Long: `Queue an image pull on a node's work queue. The node's puller applies the kubelet's pull policy, backoff and
credentials, and answers with events (imagefleet.evt.<node>.pull.pulling|pulled|failed). With --wait the command
subscribes to the result before queueing and prints it; it exits 1 when the pull failed. A full queue (one pull
and ten waiting in serial mode) is refused at once.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := requireNode(node); err != nil {
				return err
			}
			req := events.PullRequest{ID: requestID, Image: args[0], Policy: policy, Secrets: secrets, AllowPrivate: allowPrivate,
				Enqueued: time.Now().UTC()}
			if req.ID == "" {
				req.ID = events.NewID()
			}
			if pod != "" {
				parts := strings.Split(pod, "/")
				if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
					return fmt.Errorf("--pod %q must be NAMESPACE/NAME/UID", pod)
				}
				req.Pod = &events.PodRef{Namespace: parts[0], Name: parts[1], UID: parts[2]}
			}
			if err := req.Validate(); err != nil {
				return fmt.Errorf("pull request: %w", err)
			}
			ctx := cmd.Context()
			b, err := cl.connect(ctx, "imagefleet-pull")
			if err != nil {
				return err
			}
			defer b.Close()
			return cl.runPull(ctx, cmd, b, node, req, wait, waitTimeout)
		},
	}
	f := cmd.Flags()
	f.StringVar(&node, "node", "", "node name")
	f.StringVar(&policy, "policy", "", "pull policy: Always, IfNotPresent or Never (default: Kubernetes' defaulting, Always for :latest or untagged)")
	f.StringVar(&pod, "pod", "", "the pod pulling, NAMESPACE/NAME/UID (keys the backoff; needed for --secret)")
	f.StringSliceVar(&secrets, "secret", nil, "name of an image pull secret in the pod's namespace (repeatable)")
	f.BoolVar(&wait, "wait", false, "wait for the result and print it")
	f.BoolVar(&allowPrivate, "allow-private", false, "without --pod: let the pull use the node's registry credentials (--node-keyring); the image then has no kubelet pull record and any pod on the node may use it (docs/kubernetes.md)")
	f.DurationVar(&waitTimeout, "wait-timeout", 10*time.Minute, "how long --wait waits for the result")
	f.StringVar(&requestID, "request-id", "", "request id (default: random); a retried publish with the same id is stored once")
	return cmd
}

func (cl *cli) runPull(ctx context.Context, cmd *cobra.Command, b *bus.Bus, node string, req events.PullRequest, wait bool, waitTimeout time.Duration) error {
	var sub *bus.Subscription
	if wait {
		// Subscribe before publishing: the result cannot come before the subscription.
		var err error
		if sub, err = b.SubscribeSync(ctx, events.EventSubject(node, events.EntityPull, "*")); err != nil {
			return err
		}
		defer sub.Close()
	}
	pctx, cancel := cl.contextTimeout(ctx)
	defer cancel()
	// A node on a leaf with a JetStream domain of its own is reached through its domain (docs/operations.md).
	domain, err := fleet.NodeDomain(pctx, b, node)
	if err != nil {
		return err
	}
	_, err = puller.EnqueueIn(pctx, b, domain, node, req)
	cancel()
	if errors.Is(err, puller.ErrPullQueueFull) {
		return fmt.Errorf("pull queue of node %s is full (%d requests in flight or waiting): try again later", node, events.MaxPullRequestsPerNode)
	}
	if err != nil {
		return err
	}
	out := pullOutput{Node: node, Queued: true, PullResult: events.PullResult{RequestID: req.ID, Image: req.Image, Policy: req.Policy, Pod: req.Pod}}
	if !wait {
		if cl.jsonOutput() {
			return printJSON(cmd.OutOrStdout(), out)
		}
		fmt.Fprintf(cmd.OutOrStdout(), "queued pull of %s on %s (request %s)\n", req.Image, node, req.ID)
		return nil
	}
	wctx, wcancel := context.WithTimeout(ctx, waitTimeout)
	defer wcancel()
	for {
		_, header, data, err := sub.NextMsg(wctx)
		if err != nil {
			return fmt.Errorf("waiting for the result of request %s on %s: %w", req.ID, node, err)
		}
		ev, err := events.DecodeEventMsg(header, data)
		if err != nil {
			continue
		}
		var r events.PullResult
		if err := ev.DecodeData(&r); err != nil || r.RequestID != req.ID {
			continue
		}
		if ev.Is(events.EntityPull, events.ActionPulling) {
			if !cl.jsonOutput() {
				fmt.Fprintf(cmd.ErrOrStderr(), "%s: %s\n", ev.Reason, ev.Message)
			}
			continue
		}
		out.PullResult, out.Reason = r, ev.Reason
		if cl.jsonOutput() {
			if err := printJSON(cmd.OutOrStdout(), out); err != nil {
				return err
			}
		} else if r.Error == "" {
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\nimageRef: %s\n", ev.Reason, ev.Message, r.ImageRef)
		} else {
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\n%s: %s\n", ev.Reason, ev.Message, r.Error, r.Message)
		}
		if r.Error != "" {
			return exitError{code: 1, err: fmt.Errorf("pull of %s on %s: %s: %s", req.Image, node, r.Error, r.Message)}
		}
		return nil
	}
}
