package fleet

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// validate checks cfg with exact messages and fills the defaults.
func (c *RolloutConfig) validate() error {
	if c.ID == "" {
		c.ID = NewRolloutID(c.Kind)
	}
	if err := events.ValidateRolloutID(c.ID); err != nil {
		return err
	}
	switch c.Kind {
	case events.RolloutGC, events.RolloutPull:
	default:
		return fmt.Errorf("rollout kind %q must be gc or pull", c.Kind)
	}
	if c.InitialBatch < 0 {
		return fmt.Errorf("initial batch %d must be at least 1", c.InitialBatch)
	}
	if c.InitialBatch == 0 {
		c.InitialBatch = SlowStartInitialBatchSize
	}
	if c.MaxInFlight < 0 {
		return fmt.Errorf("max in flight %d must be at least 1", c.MaxInFlight)
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxFailures < 0 {
		return fmt.Errorf("max failures %d must not be negative", c.MaxFailures)
	}
	if c.MaxFailures == 0 {
		c.MaxFailures = 1000
	}
	if err := c.FailureBudget.validate(); err != nil {
		return err
	}
	if c.NodeTimeout < 0 {
		return fmt.Errorf("node timeout %v must not be negative", c.NodeTimeout)
	}
	if c.NodeTimeout == 0 {
		c.NodeTimeout = 60 * time.Second
	}
	seen := map[string]bool{}
	for _, n := range c.Nodes {
		if err := events.ValidateNodeName(n); err != nil {
			return err
		}
		if seen[n] {
			return fmt.Errorf("node %s is listed twice", n)
		}
		seen[n] = true
	}
	if c.Kind == events.RolloutPull && c.Image == "" {
		return fmt.Errorf("a pull rollout needs an image")
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}
