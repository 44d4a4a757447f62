package puller

import (
	"context"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// connectCluster connects to c and ensures the streams with a replica per server (R3 on three).
func connectCluster(tb testing.TB, c *bustest.Cluster, name string) *bus.Bus {
	tb.Helper()
	b := c.Connect(name)
	ensureStreams(tb, b, bus.StreamsConfig{Replicas: c.N()}, 2*time.Minute)
	return b
}

// ensureStreams ensures the streams with cfg (an operator's bus init, or an agent's start), asking again
// until they are made or limit has passed.
func ensureStreams(tb testing.TB, b *bus.Bus, cfg bus.StreamsConfig, limit time.Duration) {
	tb.Helper()
	bustest.Eventually(tb, "the streams", limit, func() error {
		ctx, cancel := context.WithTimeout(tb.Context(), 30*time.Second)
		defer cancel()
		return b.EnsureStreams(ctx, cfg)
	})
}
