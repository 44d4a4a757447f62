package fleet_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// scriptedGC answers every node's GC command (imagefleet.cmd.*.gc) on one subscription of one connection
// with a scripted result, so what a test or benchmark measures is the orchestrator, not the agents. It
// answers a repeated request id as the real executor does (services/gc: from memory, no second pass) and
// counts the passes per node: a node with two passes was acted on twice.
type scriptedGC struct {
	// images is how many images each pass removes (or would remove), each of imageSize bytes.
	images    int
	imageSize int64
	// fail, when set, makes the nodes it names answer with a kubelet-style failure.
	fail func(node string) bool
	// delay is how long a pass takes (a repeated id waits for nothing).
	delay time.Duration

	mu       sync.Mutex
	passes   map[string]int  // node -> passes run
	seen     map[string]bool // request ids answered
	requests atomic.Int64    // requests answered, repeats included
}

// scriptedSubs subscriptions in one queue group answer scriptedHandlers requests at once: a burst of a
// thousand requests (a batch) overflows no subscription's buffer (a dropped request would cost GCAction's
// 15 s attempt timeout) and scripted delays overlap.
const (
	scriptedSubs     = 8
	scriptedHandlers = 1024
)

func newScriptedGC(images int) *scriptedGC {
	return &scriptedGC{images: images, imageSize: 10 << 20, passes: map[string]int{}, seen: map[string]bool{}}
}

// serve answers until ctx ends (the subscriptions end with ctx).
func (s *scriptedGC) serve(t testing.TB, ctx context.Context, b *bus.Bus) {
	t.Helper()
	var wg sync.WaitGroup
	for range scriptedSubs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = b.ServeConcurrent(ctx, events.Prefix+".cmd.*."+events.VerbGC, "scripted-gc", scriptedHandlers/scriptedSubs, s.handle)
		}()
	}
	t.Cleanup(wg.Wait)
}

// handle runs one GC request. The node is the request id's part after the rollout id (GCAction sets
// <rollout id>.<node token>; the scripted node names are their own tokens).
func (s *scriptedGC) handle(_ context.Context, data []byte) (any, error) {
	var req events.GCRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	_, node, ok := strings.Cut(req.ID, ".")
	if !ok {
		return nil, fmt.Errorf("scripted GC needs a request id <rollout>.<node>, got %q", req.ID)
	}
	s.requests.Add(1)
	s.mu.Lock()
	first := !s.seen[req.ID]
	if first { // a repeated id is answered from memory: the same answer, no second pass
		s.seen[req.ID] = true
		s.passes[node]++
	}
	s.mu.Unlock()
	if first && s.delay > 0 {
		time.Sleep(s.delay)
	}
	res := events.GCResult{Node: node, DryRun: req.DryRun, AllUnused: req.AllUnused, Started: time.Now().UTC(),
		Removed: make([]events.GCRemoved, 0, s.images), Skipped: []events.GCSkipped{}}
	if s.fail != nil && s.fail(node) {
		res.Error = "failed to garbage collect required amount of images"
		return res, nil
	}
	for i := range s.images {
		res.Removed = append(res.Removed, events.GCRemoved{ID: fmt.Sprintf("sha256:%064x", i),
			RepoTags: []string{fmt.Sprintf("registry.example/app-%d:v1", i)}, Size: s.imageSize, Reason: "unused"})
		if !req.DryRun {
			res.FreedBytes += s.imageSize
		}
	}
	return res, nil
}

// passesOf returns the passes run per node.
func (s *scriptedGC) passesOf() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.passes))
	for k, v := range s.passes {
		out[k] = v
	}
	return out
}
