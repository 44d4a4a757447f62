package detector

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// Config configures the detector.
type Config struct {
	// Node is the node name (required).
	Node string
	// Period between detections (default 5m, the kubelet's image detection period).
	Period time.Duration
	// Now is the clock (default time.Now). The kubelet sets lastUsed from the wall clock, not the detect time.
	Now func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

func (c *Config) setDefaults() error {
	if err := events.ValidateNodeName(c.Node); err != nil {
		return err
	}
	if c.Period == 0 {
		c.Period = 5 * time.Minute
	}
	if c.Period < 0 {
		return fmt.Errorf("detect period %v must not be negative", c.Period)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}
