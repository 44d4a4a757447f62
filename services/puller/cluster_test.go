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
	bustest.Eventually(tb, "the streams", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(tb.Context(), 30*time.Second)
		defer cancel()
		return b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: c.N()})
	})
	return b
}
