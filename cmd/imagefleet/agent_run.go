package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sync/errgroup"
)

// An agent at run time: its workers run as one, and ready once every one of them is.

// runnable is a worker: Run blocks until ctx ends and returns nil after a clean shutdown.
type runnable interface {
	Run(ctx context.Context) error
}

// readier is a worker that says when it can do its job: Ready closes once its subscriptions and consumers
// are at the server, and for some once a first piece of work is done (the pod index caught up, the
// detector's first detection, the heartbeat's first write, a pod source's first sync, the inventory's index
// loaded). A worker without Ready counts as ready as soon as it runs: the agent cannot tell more.
type readier interface {
	Ready() <-chan struct{}
}

// readySignals are w's Ready channel, or those of each worker of a group.
func readySignals(w runnable) []<-chan struct{} {
	switch w := w.(type) {
	case group:
		var out []<-chan struct{}
		for _, m := range w {
			out = append(out, readySignals(m)...)
		}
		return out
	case readier:
		return []<-chan struct{}{w.Ready()}
	}
	return nil
}

// group runs runnables until ctx ends or one fails.
type group []runnable

func (r group) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, w := range r {
		g.Go(func() error { return w.Run(ctx) })
	}
	return g.Wait()
}

// wrapWorker, set only by tests, wraps each worker buildAgent builds: how a test makes one node's real
// worker fail after it started (TestHollowRestartsAFailedAgent), with no fault flag in the shipped command.
var wrapWorker func(node, worker string, w runnable) runnable

// agentRun is one node agent's built workers.
type agentRun struct {
	defs    []workerDef
	workers []runnable
	// ready is closed once every worker's Ready has closed (Run).
	ready     chan struct{}
	readyOnce sync.Once
}

// Ready is closed once every worker can answer its first request.
func (a *agentRun) Ready() <-chan struct{} { return a.ready }

// notReady is nil once every worker is ready, else an error naming those that are not yet.
func (a *agentRun) notReady() error {
	if closed(a.ready) {
		return nil
	}
	var names []string
	for i, w := range a.workers {
		if slices.ContainsFunc(readySignals(w), func(c <-chan struct{}) bool { return !closed(c) }) {
			names = append(names, a.defs[i].Name)
		}
	}
	if len(names) == 0 {
		return errors.New("agent starting")
	}
	return fmt.Errorf("agent starting: not ready yet: %s", strings.Join(names, ", "))
}

// closed reports whether c is closed.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func (a *agentRun) names() []string {
	out := make([]string, len(a.defs))
	for i, d := range a.defs {
		out[i] = d.Name
	}
	return out
}

// Run runs every worker until ctx ends or one fails (which stops the others), and closes Ready once every
// worker is ready.
func (a *agentRun) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	for i, w := range a.workers {
		g.Go(func() error {
			if err := w.Run(gctx); err != nil {
				return fmt.Errorf("%s: %w", a.defs[i].Name, err)
			}
			return nil
		})
	}
	g.Go(func() error {
		for _, w := range a.workers {
			for _, c := range readySignals(w) {
				select {
				case <-c:
				case <-gctx.Done():
					return nil
				}
			}
		}
		a.readyOnce.Do(func() { close(a.ready) })
		return nil
	})
	return g.Wait()
}

// idle is a worker with nothing to run: its work happens in the bus (the journal) or in Build.
type idle struct{}

func (idle) Run(ctx context.Context) error { <-ctx.Done(); return nil }
