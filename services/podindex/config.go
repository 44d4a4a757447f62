package podindex

import (
	"fmt"
	"log/slog"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/events"
)

// Config configures the pod index of one node.
type Config struct {
	// Node is the node whose pod events are indexed (required).
	Node string
	// FlushInterval is how often changed pods and the last applied stream sequence are written to the
	// snapshot bucket while the index keeps up with its events (default 5s). A restart replays the events
	// after the last write (the stream keeps them): on a node, a few pods' worth.
	FlushInterval time.Duration
	// While the index catches up (more than 1000 events behind the stream), the snapshot is written
	// only once FlushEvents events (default 200000) were applied or FlushMaxDelay (default 30s) passed since
	// the last write: during a burst the same pods change again and again, and writing them every
	// FlushInterval doubled the messages stored, while a restart would replay those events anyway.
	FlushEvents   int
	FlushMaxDelay time.Duration
	// DecodeWorkers is how many goroutines decode pod events ahead of the one that applies them in order
	// (default GOMAXPROCS, at most 4).
	DecodeWorkers int
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the pod index's metrics (default prometheus.DefaultRegisterer, which the agent's
	// /metrics serves). Every index of a process shares one set of series; registering it again on the same
	// registry is a no-op.
	Registerer prometheus.Registerer
}

func (c *Config) setDefaults() error {
	if c.Node == "" {
		return fmt.Errorf("pod index: node name is required")
	}
	if err := events.ValidateNodeName(c.Node); err != nil {
		return fmt.Errorf("pod index: %w", err)
	}
	if c.FlushInterval < 0 {
		return fmt.Errorf("pod index: flush interval %v must not be negative", c.FlushInterval)
	}
	if c.FlushInterval == 0 {
		c.FlushInterval = 5 * time.Second
	}
	if c.FlushEvents < 0 {
		return fmt.Errorf("pod index: flush events %d must not be negative", c.FlushEvents)
	}
	if c.FlushEvents == 0 {
		c.FlushEvents = 200000
	}
	if c.FlushMaxDelay < 0 {
		return fmt.Errorf("pod index: flush max delay %v must not be negative", c.FlushMaxDelay)
	}
	if c.FlushMaxDelay == 0 {
		c.FlushMaxDelay = 30 * time.Second
	}
	c.FlushMaxDelay = max(c.FlushMaxDelay, c.FlushInterval)
	if c.DecodeWorkers < 0 {
		return fmt.Errorf("pod index: decode workers %d must not be negative", c.DecodeWorkers)
	}
	if c.DecodeWorkers == 0 {
		c.DecodeWorkers = min(runtime.GOMAXPROCS(0), 4)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	return nil
}
