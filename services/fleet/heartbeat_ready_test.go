package fleet_test

import (
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestHeartbeatReadyOnceWritten: Ready is closed only once the first heartbeat is written: at once the
// node's key is in the TTL bucket and its full record in the last-seen bucket.
func TestHeartbeatReadyOnceWritten(t *testing.T) {
	_, b := bustest.Start(t)
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: "n1.example", Period: time.Hour, TTL: 2 * time.Hour,
		Statfs: statfs}, critest.NewRuntime(), b)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-hb.Ready():
		t.Fatal("Ready closed before Run")
	default:
	}
	stop := bustest.RunService(t, hb)
	defer stop()
	select {
	case <-hb.Ready():
	case <-time.After(bustest.Timeout):
		t.Fatalf("not ready after %v", bustest.Timeout)
	}
	key := events.NodeToken("n1.example")
	if rev := revision(t, b, events.NodesBucket, key); rev == 0 {
		t.Error("no heartbeat key once ready")
	}
	if rev := revision(t, b, events.NodesSeenBucket, key); rev == 0 {
		t.Error("no full record once ready")
	}
}
