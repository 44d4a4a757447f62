package hollow

import (
	"context"
	"sync"
)

// gate holds pulls while blocked, letting one through per permit. Waiters are woken by closing wake
// (and replacing it), so a waiter can also give up when its context ends, which a sync.Cond cannot do.
type gate struct {
	mu      sync.Mutex
	blocked bool
	permits int
	waiting int
	wake    chan struct{}
}

func (g *gate) block() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.blocked = true
}

func (g *gate) release(n int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.permits += n
	g.broadcastLocked()
}

func (g *gate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.blocked, g.permits = false, 0
	g.broadcastLocked()
}

func (g *gate) held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.waiting
}

func (g *gate) broadcastLocked() {
	if g.wake != nil {
		close(g.wake)
		g.wake = nil
	}
}

// pass returns when the gate lets the caller through, or with ctx's error.
func (g *gate) pass(ctx context.Context) error {
	g.mu.Lock()
	for g.blocked && g.permits == 0 {
		if g.wake == nil {
			g.wake = make(chan struct{})
		}
		wake := g.wake
		g.waiting++
		g.mu.Unlock()
		var err error
		select {
		case <-wake:
		case <-ctx.Done():
			err = ctx.Err()
		}
		g.mu.Lock()
		g.waiting--
		if err != nil {
			g.mu.Unlock()
			return err
		}
	}
	if g.blocked {
		g.permits--
	}
	g.mu.Unlock()
	return nil
}
