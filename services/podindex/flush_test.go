package podindex

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/events"
)

func TestSnapshotPolicy(t *testing.T) {
	p := snapshotPolicy{interval: time.Second, events: 1000, maxDelay: 10 * time.Second}
	cases := []struct {
		name    string
		backlog uint64
		since   int
		elapsed time.Duration
		forced  bool
		want    bool
	}{
		{"keeping up, interval passed", 0, 5, time.Second, false, true},
		{"keeping up, ticker a little early", catchUpBacklog, 5, 600 * time.Millisecond, false, true},
		{"keeping up, too soon", 0, 5, 400 * time.Millisecond, false, false},
		{"catching up, interval passed", catchUpBacklog + 1, 999, 9 * time.Second, false, false},
		{"catching up, enough events", 50000, 1000, time.Millisecond, false, true},
		{"catching up, max delay", 50000, 1, 10 * time.Second, false, true},
		{"after a dead letter", 50000, 0, 0, true, true},
	}
	for _, tc := range cases {
		if got := p.due(tc.backlog, tc.since, tc.elapsed, tc.forced); got != tc.want {
			t.Errorf("%s: due = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestCatchingUpWritesTheSnapshotOnceCaughtUp: an index started behind 10,000 events (1,000 pods added, then
// updated 9 times) with a 10 ms flush interval writes no snapshot while it is more than catchUpBacklog events
// behind, so each pod is written at most twice (once the backlog is under the bound, then once more if it
// changed after that write), where a write every 10 ms wrote them 2.6-4.5 times over (runs here); and once
// caught up, the snapshot reaches the last event without FlushEvents or FlushMaxDelay.
func TestCatchingUpWritesTheSnapshotOnceCaughtUp(t *testing.T) {
	b := startBus(t)
	const pods = 1000
	var last uint64
	for round := range 10 {
		action := events.ActionUpdated
		if round == 0 {
			action = events.ActionAdded
		}
		batch := make([]*v1.Pod, pods)
		for k := range batch {
			batch[k] = testPod("ns", fmt.Sprintf("p-%d", k), fmt.Sprintf("uid-%d", k), []string{"s"}, nil, fmt.Sprintf("img:%d", round))
		}
		last = publish(t, b, testNode, action, batch...)
	}

	var mu sync.Mutex
	podWrites, appliedWrites := 0, 0
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	subscribed := make(chan error, 1)
	go func() {
		subscribed <- b.Subscribe(ctx, "$KV."+SnapshotBucket+"."+events.NodeToken(testNode)+".>", func(subject string, _ []byte) {
			mu.Lock()
			defer mu.Unlock()
			if strings.HasSuffix(subject, ".applied") {
				appliedWrites++
			} else {
				podWrites++
			}
		})
	}()
	time.Sleep(100 * time.Millisecond) // the subscription is in place before the index starts

	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 10 * time.Millisecond,
		FlushEvents: 1 << 30, FlushMaxDelay: time.Hour})
	defer stop()
	waitFor(t, "all applied", func() bool { return s.State().Applied() >= last })
	waitFor(t, "the snapshot written once caught up", func() bool { return s.flushedSeq() >= last })
	mu.Lock()
	defer mu.Unlock()
	if podWrites > 2*pods || podWrites < pods || appliedWrites == 0 {
		t.Fatalf("catching up over %d events wrote %d pod records and %d applied sequences; want %d to %d pod records",
			10*pods, podWrites, appliedWrites, pods, 2*pods)
	}
	t.Logf("%d pod records, %d applied sequences written", podWrites, appliedWrites)
}
