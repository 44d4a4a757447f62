// Package fleettest has scripted node responders for the unit tests of the rollout orchestrator's own
// logic (services/fleet): a GC responder and a puller that answer the real subjects
// (imagefleet.cmd.<node>.gc, the pull work queue) over a real bus, reading a real CRI runtime, and that a
// test can make fail (Fail) or stall (Delay) on chosen nodes, and count what each node was asked. They
// implement only what a rollout observes, not the kubelet's policies (services/gc, services/puller). Scale
// tests and benchmarks do not use them: they run the real workers with `imagefleet hollow`
// (integration/hollow_test.go, integration/fleet_bench_test.go).
package fleettest

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Runtime is the part of the CRI client the stand-ins use.
type Runtime interface {
	ListImages(ctx context.Context) ([]cri.Image, error)
	ListContainers(ctx context.Context) ([]cri.Container, error)
	RemoveImage(ctx context.Context, id string) error
	PullImage(ctx context.Context, ref string, auth *cri.AuthConfig, sandbox *cri.SandboxConfig, annotations map[string]string) (string, error)
}

// Node is one stand-in node: its GC and pull handlers count what they did.
type Node struct {
	Name string
	RT   Runtime
	Bus  *bus.Bus
	// Fail, when set, makes every GC answer with this kubelet-style failure.
	Fail string
	// Delay holds every GC this long before answering (to test node timeouts).
	Delay time.Duration

	gcCalls, gcDryRuns, pulls atomic.Int64
	mu                        sync.Mutex
	requests                  []events.GCRequest
}

// GCCalls counts the GC requests this node answered (dry runs included); DryRuns the dry ones; Pulls the
// pull requests it handled.
func (n *Node) GCCalls() int64 { return n.gcCalls.Load() }

// DryRuns counts the dry-run GC requests.
func (n *Node) DryRuns() int64 { return n.gcDryRuns.Load() }

// Pulls counts the pull requests handled.
func (n *Node) Pulls() int64 { return n.pulls.Load() }

// Requests returns the GC requests received, in order.
func (n *Node) Requests() []events.GCRequest {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]events.GCRequest(nil), n.requests...)
}

// GC handles one GC request: every image no container uses and the runtime does not pin is removed (or,
// in a dry run, listed), biggest first.
func (n *Node) GC(ctx context.Context, data []byte) (any, error) {
	var req events.GCRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	n.gcCalls.Add(1)
	if req.DryRun {
		n.gcDryRuns.Add(1)
	}
	n.mu.Lock()
	n.requests = append(n.requests, req)
	n.mu.Unlock()
	if n.Delay > 0 {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(n.Delay):
		}
	}
	began := time.Now()
	res := events.GCResult{Node: n.Name, DryRun: req.DryRun, AllUnused: req.AllUnused, Started: began.UTC(),
		Removed: []events.GCRemoved{}, Skipped: []events.GCSkipped{}}
	if n.Fail != "" {
		res.Error = n.Fail
		return res, nil
	}
	imgs, err := n.RT.ListImages(ctx)
	if err != nil {
		return nil, fmt.Errorf("gc on %s: %w", n.Name, err)
	}
	ctrs, err := n.RT.ListContainers(ctx)
	if err != nil {
		return nil, fmt.Errorf("gc on %s: %w", n.Name, err)
	}
	inUse := map[string]bool{}
	for _, c := range ctrs {
		inUse[c.ImageID] = true
	}
	sort.Slice(imgs, func(i, j int) bool { return imgs[i].Size > imgs[j].Size })
	for _, im := range imgs {
		switch {
		case im.Pinned:
			res.Skipped = append(res.Skipped, events.GCSkipped{ID: im.ID, Why: "pinned"})
			continue
		case inUse[im.ID]:
			res.Skipped = append(res.Skipped, events.GCSkipped{ID: im.ID, Why: "in use"})
			continue
		}
		rm := events.GCRemoved{ID: im.ID, RepoTags: im.RepoTags, Size: im.Size, Reason: "unused"}
		if !req.DryRun {
			if err := n.RT.RemoveImage(ctx, im.ID); err != nil && !errors.Is(err, cri.ErrNotFound) {
				rm.Error = err.Error()
			} else {
				res.FreedBytes += im.Size
			}
		}
		res.Removed = append(res.Removed, rm)
	}
	res.Duration = events.Duration{Duration: time.Since(began)}
	return res, nil
}

// ServeGC answers imagefleet.cmd.<node>.gc until ctx ends.
func (n *Node) ServeGC(ctx context.Context) error {
	return n.Bus.Serve(ctx, events.CommandSubject(n.Name, events.VerbGC), events.GCQueue, n.GC)
}

// Pull handles one pull command from the work queue: it pulls through CRI and publishes pull.pulled or
// pull.failed with the result event id the puller uses (so a redelivered command reports once).
func (n *Node) Pull(ctx context.Context, m *bus.Msg) error {
	var req events.PullRequest
	if err := events.DecodeStrict(m.Data, &req); err != nil {
		return bus.Permanent(err)
	}
	n.pulls.Add(1)
	began := time.Now()
	r := events.PullResult{RequestID: req.ID, Image: req.Image, Policy: req.Policy, Deliveries: m.NumDelivered}
	ref, err := n.RT.PullImage(ctx, req.Image, nil, nil, nil)
	action := events.ActionPulled
	if err != nil {
		action = events.ActionFailed
		r.Error, r.Message = events.ErrKindImagePull, cri.RuntimeMessage(err)
	} else {
		r.ImageRef, r.Pulled = ref, true
	}
	r.Duration = events.Duration{Duration: time.Since(began)}
	r.Finished = time.Now().UTC()
	ev, err := events.New(n.Name, events.EntityPull, action, r)
	if err != nil {
		return bus.Permanent(err)
	}
	ev.ID = events.PullResultEventID(req.ID)
	return n.Bus.Publish(ctx, ev)
}

// ServePulls consumes the node's pull work queue until ctx ends.
func (n *Node) ServePulls(ctx context.Context) error {
	return n.Bus.Consume(ctx, bus.ConsumerConfig{Stream: events.PullStreamOf(n.Name), Durable: "fleettest-puller-" + events.NodeToken(n.Name),
		FilterSubjects: []string{events.PullSubject(n.Name)}, MaxAckPending: 2, AckWait: time.Minute}, n.Pull)
}
