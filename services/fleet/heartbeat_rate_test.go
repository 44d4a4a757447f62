package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func TestStretchedPeriod(t *testing.T) {
	const s = time.Second
	cases := []struct {
		name             string
		cur, base, limit time.Duration
		rate, maxRate    float64
		want             time.Duration
	}{
		{"under the rate: the base", 10 * s, 10 * s, 30 * s, 200, 500, 10 * s},
		{"twice the rate: half the correction (sqrt 2)", 10 * s, 10 * s, 30 * s, 1000, 500, 14 * s},
		{"four times: twice the period", 10 * s, 10 * s, 30 * s, 2000, 500, 20 * s},
		{"stretched, the fleet settled at the rate: kept", 20 * s, 10 * s, 30 * s, 500, 500, 20 * s},
		{"within a tenth: kept", 20 * s, 10 * s, 30 * s, 520, 500, 20 * s},
		{"a tenth or more: moved", 20 * s, 10 * s, 30 * s, 620, 500, 22 * s},
		{"the fleet shrank: back toward the base", 20 * s, 10 * s, 30 * s, 300, 500, 15 * s},
		{"far under: the base, never below", 20 * s, 10 * s, 30 * s, 10, 500, 10 * s},
		{"far over: the limit, a third of the TTL", 10 * s, 10 * s, 30 * s, 100000, 500, 30 * s},
		{"within a tenth below the limit, far over: the limit", 28 * s, 10 * s, 30 * s, 1000, 500, 30 * s},
		{"within a tenth below a sub-second limit, far over: the limit", 1973775315, 500 * time.Millisecond, 2 * s, 66, 20, 2 * s},
		{"above a limit lowered since, at the rate: the limit", 30 * s, 10 * s, 20 * s, 500, 500, 20 * s},
		{"a limit under the base: the base", 10 * s, 10 * s, 5 * s, 100000, 500, 10 * s},
		{"whole seconds when the base is", 10 * s, 10 * s, 30 * s, 1234, 500, 16 * s},
		{"sub-second base: not rounded", 100 * time.Millisecond, 100 * time.Millisecond, s, 40, 10, 200 * time.Millisecond},
	}
	for _, c := range cases {
		if got := fleet.StretchedPeriod(c.cur, c.base, c.limit, c.rate, c.maxRate); got != c.want {
			t.Errorf("%s: stretchedPeriod(%v, %v, %v, %v, %v) = %v, want %v", c.name, c.cur, c.base, c.limit, c.rate, c.maxRate, got, c.want)
		}
	}
}

// TestHeartbeatStretchesItsPeriodAboveMaxRate: a heartbeat whose bucket takes more than MaxRate writes per
// second (other nodes' heartbeats, written here at ~100/s) stretches its period up to a third of the
// bucket's TTL, and says so in the period its records carry; when the others stop it comes back to its
// configured period.
func TestHeartbeatStretchesItsPeriodAboveMaxRate(t *testing.T) {
	_, b := bustest.Start(t)
	// A beat has one period to be written: 500 ms leaves room on a loaded machine.
	const period, ttl = 500 * time.Millisecond, 6 * time.Second
	hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: "n1.example", Period: period, TTL: ttl, MaxRate: 20,
		Statfs: func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }}, critest.NewRuntime(), b)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b.KV(t.Context(), bus.KVConfig{Bucket: events.NodesBucket, TTL: ttl, Replicas: 1,
		Description: "imagefleet node heartbeats; a key expires when its node stops"})
	if err != nil {
		t.Fatal(err)
	}
	others, stopOthers := context.WithCancel(t.Context())
	othersDone := make(chan struct{})
	go func() {
		defer close(othersDone)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-others.Done():
				return
			case <-tick.C:
			}
			if _, err := alive.Put(others, fmt.Sprintf("other-%d", i%50), []byte(`{}`)); err != nil && others.Err() == nil {
				t.Errorf("other node's heartbeat: %v", err)
				return
			}
		}
	}()
	defer func() { stopOthers(); <-othersDone }()
	stop := bustest.RunFunc(t, "heartbeat", hb.Run)
	defer stop()

	key := events.NodeToken("n1.example")
	recorded := func() time.Duration {
		raw, _, err := alive.Get(t.Context(), key)
		if err != nil {
			return 0
		}
		var a events.NodeAlive
		if err := json.Unmarshal(raw, &a); err != nil {
			t.Fatalf("alive record %s: %v", raw, err)
		}
		return a.Period.Duration
	}
	bustest.WaitWithin(t, "the period stretched to a third of the TTL", 30*time.Second, func() bool { return recorded() == ttl/3 })
	stopOthers()
	<-othersDone
	bustest.WaitWithin(t, "the period back to the configured one", 30*time.Second, func() bool { return recorded() == period })
}
