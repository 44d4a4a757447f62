package podindex

import (
	"fmt"
	"log/slog"
	"runtime"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// Config configures the pod index of one node.
type Config struct {
	// Node is the node whose pod events are indexed (required).
	Node string
	// FlushInterval is how often changed pods and the last applied stream sequence are written to the
	// snapshot bucket (default 1s). A restart replays at most the events after the last flush.
	FlushInterval time.Duration
	// FlushEvents forces a flush once this many events were applied since the last one (default 20000).
	FlushEvents int
	// DecodeWorkers is how many goroutines decode pod events ahead of the one that applies them in order
	// (default GOMAXPROCS, at most 4).
	DecodeWorkers int
	// Logger (default slog.Default()).
	Logger *slog.Logger
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
		c.FlushInterval = time.Second
	}
	if c.FlushEvents < 0 {
		return fmt.Errorf("pod index: flush events %d must not be negative", c.FlushEvents)
	}
	if c.FlushEvents == 0 {
		c.FlushEvents = 20000
	}
	if c.DecodeWorkers < 0 {
		return fmt.Errorf("pod index: decode workers %d must not be negative", c.DecodeWorkers)
	}
	if c.DecodeWorkers == 0 {
		c.DecodeWorkers = min(runtime.GOMAXPROCS(0), 4)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}
