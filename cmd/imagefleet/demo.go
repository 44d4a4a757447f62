package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/puller"
)

type demoFlags struct {
	node     string
	images   int
	capacity int64
	keep     bool
}

func newDemoCmd(cl *cli) *cobra.Command {
	var f demoFlags
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the whole pipeline on an embedded nats-server and a hollow CRI runtime",
		Long: `Starts an embedded nats-server (JetStream, temporary store), a hollow CRI runtime (a real gRPC CRI
server holding images in memory) filled over its GC threshold, and the node agent with every worker; then
detects, lists, plans and runs image GC, pulls, and prints the event feed and a summary. Needs nothing installed.`,
		RunE: func(cmd *cobra.Command, _ []string) error { return runDemo(cmd.Context(), cmd.OutOrStdout(), f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.node, "node", "demo-node", "node name")
	fs.IntVar(&f.images, "images", 24, "images on the hollow node")
	fs.Int64Var(&f.capacity, "capacity", 8<<30, "image filesystem capacity of the hollow node, bytes")
	fs.BoolVar(&f.keep, "keep-running", false, "keep the agent running after the demo (Ctrl-C to stop)")
	return cmd
}

// demoStep prints numbered progress lines with their duration.
type demoStep struct {
	w     io.Writer
	n     int
	total int
	start time.Time
}

func (s *demoStep) begin(format string, args ...any) {
	s.n++
	s.start = time.Now()
	fmt.Fprintf(s.w, "[%d/%d] %s ... ", s.n, s.total, fmt.Sprintf(format, args...))
}

func (s *demoStep) done(format string, args ...any) {
	fmt.Fprintf(s.w, "%s (%s)\n", fmt.Sprintf(format, args...), time.Since(s.start).Round(time.Millisecond))
}

func runDemo(ctx context.Context, w io.Writer, f demoFlags) error {
	if err := events.ValidateNodeName(f.node); err != nil {
		return err
	}
	if f.images < 4 {
		return fmt.Errorf("--images %d: at least 4", f.images)
	}
	began := time.Now()
	st := &demoStep{w: w, total: 9}
	dir, err := os.MkdirTemp("", "imagefleet-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	st.begin("embedded nats-server")
	srv, err := bus.StartServer(bus.ServerConfig{Listen: "127.0.0.1:-1", StoreDir: filepath.Join(dir, "nats")})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	st.done("%s, JetStream store in %s", srv.ClientURL(), dir)

	st.begin("hollow CRI runtime %q", f.node)
	rt := hollow.New(hollow.Options{Name: f.node, Capacity: f.capacity, PullLatency: 150 * time.Millisecond})
	rctx, stopRuntime := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRuntime()
	endpoint, stopSock, err := rt.StartUnix(rctx, filepath.Join(dir, "cri.sock"))
	if err != nil {
		return err
	}
	defer stopSock()
	seed, err := seedHollow(rt, f)
	if err != nil {
		return err
	}
	st.done("%s: %d images (%s of %s), %d containers keep %d in use, pause image pinned by policy",
		endpoint, seed.images, FormatSize(seed.bytes), FormatSize(f.capacity), seed.containers, seed.containers)

	st.begin("node agent")
	agentCtx, stopAgent := context.WithCancel(ctx)
	agentDone := make(chan error, 1)
	args := []string{"agent", "--nats", srv.ClientURL(), "--node", f.node, "--cri", endpoint,
		"--data-dir", filepath.Join(dir, "agent"), "--log-level", "warn"}
	root := newRootCmd()
	agentCmd, _, _ := root.Find([]string{"agent"})
	for flag, val := range map[string]string{
		"image-fs-capacity":          fmt.Sprint(f.capacity),
		"pinned-images":              "*/pause:*",
		"minimum-image-ttl-duration": "0s", // the demo's images are all "new"; the kubelet's default is 2m
		"image-gc-period":            "1h", // GC runs when the demo asks
	} {
		if agentCmd != nil && agentCmd.Flags().Lookup(flag) != nil {
			args = append(args, "--"+flag, val)
		}
	}
	root.SetArgs(args)
	root.SetOut(io.Discard)
	go func() { agentDone <- root.ExecuteContext(agentCtx) }()
	defer func() {
		stopAgent()
		<-agentDone
	}()
	b, err := bus.Connect(ctx, srv.ClientURL(), bus.Options{Name: "imagefleet-demo"})
	if err != nil {
		return err
	}
	defer b.Close()
	var det events.DetectReply
	if err := waitReady(ctx, agentDone, func(c context.Context) error {
		return b.Request(c, events.CommandSubject(f.node, events.VerbDetect), events.DetectRequest{}, &det)
	}); err != nil {
		return err
	}
	var workers []string
	for _, d := range agentWorkers {
		if d.Default {
			workers = append(workers, d.Name)
		}
	}
	st.done("workers %s", strings.Join(workers, ","))

	st.begin("detect")
	rc, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := b.Request(rc, events.CommandSubject(f.node, events.VerbDetect), events.DetectRequest{}, &det); err != nil {
		return err
	}
	st.done("%d records, %d in use", det.Records, det.InUse)

	st.begin("image list (node status, top 5 by size)")
	var imgs events.ImagesReply
	if err := waitReady(ctx, agentDone, func(c context.Context) error {
		return b.Request(c, events.QuerySubject(f.node, events.QryImages), events.QueryRequest{Limit: 5}, &imgs)
	}); err != nil {
		return err
	}
	var top []string
	for _, im := range imgs.Images {
		top = append(top, fmt.Sprintf("%s %s", firstTag(im.RepoTags, im.ID), FormatSize(im.Size)))
	}
	st.done("%s", strings.Join(top, ", "))

	st.begin("image GC dry run")
	var plan events.GCResult
	gcErr := b.Request(rc, events.CommandSubject(f.node, events.VerbGC), events.GCRequest{DryRun: true}, &plan)
	if gcErr != nil {
		st.done("unavailable: %v", gcErr)
	} else {
		st.done("usage %d%%, %s to free: would remove %d images, %s (%d kept)", plan.UsagePercent, FormatSize(plan.AmountToFree),
			len(plan.Removed), FormatSize(plan.FreedBytes), len(plan.Skipped))
	}

	st.begin("image GC")
	var res events.GCResult
	if gcErr == nil {
		if err := b.Request(rc, events.CommandSubject(f.node, events.VerbGC), events.GCRequest{}, &res); err != nil {
			return err
		}
		capacity, used := rt.FsUsage()
		st.done("removed %d, %d failed, freed %s; usage %d%% -> %d%%", len(res.Succeeded()), res.FailedCount(), FormatSize(res.FreedBytes),
			res.UsagePercent, 100-int((capacity-used)*100/capacity))
	} else {
		st.done("skipped")
	}

	st.begin("pulls through the work queue")
	var pulls []string
	var results []string // the pull results' event IDs, which the feed below waits for
	for _, p := range []struct{ image, policy string }{
		{"docker.io/library/nginx:1.27", events.PullIfNotPresent},
		{"docker.io/library/nginx:1.27", events.PullIfNotPresent},
		{"FAILED_IMAGE", events.PullAlways},
		{"docker.io/library/traefik:3", events.PullNever},
	} {
		r, ev, err := demoPull(ctx, b, f.node, p.image, p.policy)
		reason := ev.Reason
		if err == nil {
			results = append(results, ev.ID)
		}
		switch {
		case err != nil:
			pulls = append(pulls, fmt.Sprintf("%s: %v", p.image, err))
		case r.Error != "":
			pulls = append(pulls, fmt.Sprintf("%s (%s): %s", p.image, p.policy, r.Error))
		case r.Pulled:
			pulls = append(pulls, fmt.Sprintf("%s (%s): %s in %s", p.image, p.policy, reason, r.PullDuration.Round(time.Millisecond)))
		default:
			pulls = append(pulls, fmt.Sprintf("%s (%s): %s, already present", p.image, p.policy, reason))
		}
	}
	st.done("%s", strings.Join(pulls, "; "))

	st.begin("event feed")
	counts, warnings, err := demoFeed(rc, b, f.node, results)
	if err != nil {
		return err
	}
	var parts []string
	for t, n := range counts {
		parts = append(parts, fmt.Sprintf("%s x%d", strings.TrimSuffix(strings.TrimPrefix(t, "imagefleet."), ".v1"), n))
	}
	st.done("%s", strings.Join(sortedStrings(parts), ", "))
	for _, wmsg := range warnings {
		fmt.Fprintf(w, "      Warning %s\n", wmsg)
	}

	fmt.Fprintf(w, "\nSummary: node %s, %d images detected, %d in use; GC freed %s in %d removals; %d events in the feed; %s in all.\n",
		f.node, det.Records, det.InUse, FormatSize(res.FreedBytes), len(res.Removed), sumCounts(counts), time.Since(began).Round(time.Millisecond))
	fmt.Fprintf(w, "Try it against a real containerd: imagefleet agent --node $(hostname) --cri unix:///run/containerd/containerd.sock\n")
	if f.keep {
		fmt.Fprintf(w, "\nThe agent keeps running on %s (node %s). Ctrl-C to stop.\n", srv.ClientURL(), f.node)
		select {
		case <-ctx.Done():
		case err := <-agentDone:
			agentDone <- err
		}
	}
	return nil
}

// demoFeed reads node's events from the stream: a count per type and the warnings. A subscriber can see an
// event before the stream has stored it, so the feed is read again (for up to 5 s) until it holds every
// event of want, the pull results just waited for.
func demoFeed(ctx context.Context, b *bus.Bus, node string, want []string) (map[string]int, []string, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		counts := map[string]int{}
		var warnings []string
		seen := map[string]bool{}
		err := b.Read(ctx, events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
			ev, err := events.DecodeEventMsg(m.Header, m.Data)
			if err != nil {
				return nil
			}
			seen[ev.ID] = true
			counts[ev.Type]++
			if ev.Severity == events.Warning {
				warnings = append(warnings, ev.Reason+": "+ev.Message)
			}
			return nil
		})
		if err != nil {
			return nil, nil, err
		}
		missing := slices.ContainsFunc(want, func(id string) bool { return !seen[id] })
		if !missing || time.Now().After(deadline) {
			return counts, warnings, nil
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// demoPull queues a pull and waits for its result event, as `imagefleet pull --wait` does.
func demoPull(ctx context.Context, b *bus.Bus, node, image, policy string) (events.PullResult, events.Event, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sub, err := b.SubscribeSync(ctx, events.EventSubject(node, events.EntityPull, "*"))
	if err != nil {
		return events.PullResult{}, events.Event{}, err
	}
	defer sub.Close()
	req := events.PullRequest{ID: events.NewID(), Image: image, Policy: policy, Enqueued: time.Now()}
	if _, err := puller.Enqueue(ctx, b, node, req); err != nil {
		return events.PullResult{}, events.Event{}, err
	}
	for {
		_, header, data, err := sub.NextMsg(ctx)
		if err != nil {
			return events.PullResult{}, events.Event{}, err
		}
		ev, err := events.DecodeEventMsg(header, data)
		if err != nil || ev.Is(events.EntityPull, events.ActionPulling) {
			continue
		}
		var r events.PullResult
		if ev.DecodeData(&r) == nil && r.RequestID == req.ID {
			return r, ev, nil
		}
	}
}

type seeded struct {
	images, containers int
	bytes              int64
}

// seedHollow fills the hollow node to about 92% of capacity with images of varied sizes, pins nothing (the
// pause image is protected by --pinned-images, as containerd 1.6 does not pin it), and runs containers that
// keep three images in use.
func seedHollow(rt *hollow.Runtime, f demoFlags) (seeded, error) {
	var s seeded
	if _, err := rt.AddImage(cri.Image{RepoTags: []string{"registry.k8s.io/pause:3.10"}, Size: 700 << 10}); err != nil {
		return s, err
	}
	n := f.images - 1
	target := f.capacity * 92 / 100
	names := []string{"nginx", "redis", "postgres", "busybox", "alpine", "python", "node", "golang", "envoy", "grafana", "prometheus", "etcd"}
	weights := int64(0)
	for i := range n {
		weights += int64(i%5 + 1)
	}
	for i := range n {
		size := target * int64(i%5+1) / weights
		tag := fmt.Sprintf("docker.io/library/%s:%d.%d", names[i%len(names)], 1+i/len(names), i%7)
		im, err := rt.AddImage(cri.Image{RepoTags: []string{tag}, Size: size})
		if err != nil {
			return s, err
		}
		s.bytes += im.Size
		if i%7 == 3 && s.containers < 3 {
			if _, err := rt.AddContainer(cri.Container{Name: fmt.Sprintf("app-%d", i), ImageID: im.ID, State: cri.ContainerRunning}); err != nil {
				return s, err
			}
			s.containers++
		}
	}
	s.images = n + 1
	return s, nil
}

// waitReady retries call until it answers, the agent exits, or 30 s pass.
func waitReady(ctx context.Context, agentDone chan error, call func(context.Context) error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := call(c)
		cancel()
		if err == nil {
			return nil
		}
		if !errors.Is(err, bus.ErrNoResponders) && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		select {
		case aerr := <-agentDone:
			agentDone <- aerr
			return fmt.Errorf("agent stopped: %v", aerr)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent not ready after 30s: %w", err)
		}
	}
}

func firstTag(tags []string, id string) string {
	if len(tags) > 0 {
		return tags[0]
	}
	return shortID(id)
}

func sumCounts(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func sortedStrings(s []string) []string {
	out := append([]string(nil), s...)
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j] < out[j-1]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}
