package gc

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

// TestReadyMeansSubscribed: once Ready has closed, a pull.pulled event published from another connection
// starts a usage check (the test publishes it once; both periods are an hour, so only the event can start
// one), and the gc command is answered. Several starts, each sent the event and the command the moment it is
// Ready, in turn one first then the other.
func TestReadyMeansSubscribed(t *testing.T) {
	const starts = 20
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv) // the asker is not the worker's connection, as in an agent
	rt := critest.NewRuntime(makeImage(0, 100))
	statfs := func(string) (int64, int64, error) { return 1000, 500, nil } // 50 %: under the high threshold
	for i := range starts {
		s := newService(t, b, Config{Period: time.Hour, CheckPeriod: time.Hour}, rt, gctest.NewRecords(rt, nil), statfs)
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		select {
		case <-s.Ready():
		case err := <-done:
			t.Fatalf("start %d: run: %v", i, err)
		case <-time.After(bustest.Timeout):
			t.Fatalf("start %d: not ready after %v", i, bustest.Timeout)
		}
		publish := func() {
			pulled, err := events.New(testNode, events.EntityPull, events.ActionPulled, events.PullResult{})
			if err != nil {
				t.Fatal(err)
			}
			if err := client.Publish(t.Context(), pulled); err != nil {
				t.Fatal(err)
			}
		}
		// A malformed command: answered (with an error) without a pass, which would skip the usage check.
		command := func() {
			rctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			err := client.Request(rctx, gcSubject(), []byte(`{"dryRun":`), nil)
			if errors.Is(err, bus.ErrNoResponders) {
				t.Fatalf("start %d: the gc command sent after Ready found no responders", i)
			} else if !errors.Is(err, bus.ErrRemote) {
				t.Fatalf("start %d: malformed gc command: %v, want the executor's error", i, err)
			}
		}
		// Whichever goes first is sent the moment Ready closes.
		if i%2 == 0 {
			publish()
			command()
		} else {
			command()
			publish()
		}
		bustest.Eventually(t, fmt.Sprintf("start %d: the pull event published after Ready to start a usage check", i), 5*time.Second, func() error {
			if got := testutil.ToFloat64(s.metrics.usage); got != 50 {
				return fmt.Errorf("usage gauge %v", got)
			}
			return nil
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("start %d: run returned %v", i, err)
		}
	}
}
