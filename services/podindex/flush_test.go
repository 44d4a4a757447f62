package podindex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
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
	// The server copies the events into the pods stream a little after it stores them; an index started
	// before the copy is done reads a small backlog and writes as if it kept up (under load in CI: 3,352 pod
	// records). The flush rule is what is tested here, so the copy is awaited first.
	bustest.WaitFor(t, "every event copied into the pods stream", func() bool {
		info, err := b.Stream(t.Context(), events.PodsStream)
		return err == nil && info.LastSeq >= 10*pods
	})

	w := watchSnapshot(t, b)
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 10 * time.Millisecond,
		FlushEvents: 1 << 30, FlushMaxDelay: time.Hour})
	defer stop()
	bustest.WaitFor(t, "all applied", func() bool { return s.State().Applied() >= last })
	bustest.WaitFor(t, "the snapshot written once caught up", func() bool { return s.flushedSeq() >= last })
	podWrites, applied := w.writes()
	appliedWrites := len(applied)
	if podWrites > 2*pods || podWrites < pods || appliedWrites == 0 {
		t.Fatalf("catching up over %d events wrote %d pod records and %d applied sequences; want %d to %d pod records",
			10*pods, podWrites, appliedWrites, pods, 2*pods)
	}
	t.Logf("%d pod records, %d applied sequences written", podWrites, appliedWrites)
}

// snapshotWrites records the snapshot bucket's writes for testNode as the server sees them.
type snapshotWrites struct {
	mu        sync.Mutex
	pods      int      // pod records written or deleted
	applied   []uint64 // the applied sequences written, in order
	pos       int      // the pods stream positions written
	confirmed int      // the confirmed sequences written (before each write of pod records)
	marker    bool     // the test's marker key was written
}

// watchSnapshot subscribes to the snapshot bucket's subjects of testNode (in place when it returns) until the
// test ends.
func watchSnapshot(t *testing.T, b *bus.Bus) *snapshotWrites {
	t.Helper()
	sub, err := b.SubscribeSync(t.Context(), "$KV."+snapshotBucket+"."+events.NodeToken(testNode)+".>")
	if err != nil {
		t.Fatal(err)
	}
	w := &snapshotWrites{}
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); <-done; sub.Close() })
	go func() {
		defer close(done)
		for {
			subject, data, err := sub.Next(ctx)
			if err != nil {
				return
			}
			w.mu.Lock()
			if strings.HasSuffix(subject, ".applied") {
				seq, err := strconv.ParseUint(string(data), 10, 64)
				if err != nil {
					t.Errorf("applied sequence %q: %v", data, err)
				}
				w.applied = append(w.applied, seq)
			} else if strings.HasSuffix(subject, ".pos") {
				w.pos++ // written with the applied sequence: not a pod record
			} else if strings.HasSuffix(subject, ".confirmed") {
				w.confirmed++ // written before the pod records: not one
			} else if strings.HasSuffix(subject, ".marker") {
				w.marker = true // a test's, after the writes it waits for
			} else {
				w.pods++
			}
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *snapshotWrites) marked() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.marker
}

func (w *snapshotWrites) writes() (pods int, applied []uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pods, slices.Clone(w.applied)
}

// TestConfirmOnlyFlush: a flush that does not write the snapshot (the index is catching up) still confirms
// the registration events published since the last one and empties their queue, writes nothing to the
// snapshot bucket and leaves the changed pods dirty, so the next write stores them.
func TestConfirmOnlyFlush(t *testing.T) {
	b := startBus(t)
	w := watchSnapshot(t, b)
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: time.Hour, FlushEvents: 1 << 30, FlushMaxDelay: time.Hour})
	defer stop()
	last := publish(t, b, testNode, events.ActionAdded,
		testPod("ns", "a", "uid-a", []string{"s1", "s2"}, []string{"c1"}, "img:1"),
		testPod("ns", "b", "uid-b", []string{"s1"}, nil, "img:1"))
	bustest.WaitFor(t, "applied", func() bool { return s.State().Applied() >= last })
	s.mu.Lock()
	queued := 0
	for _, pe := range s.pending {
		queued += len(pe.evs)
	}
	s.mu.Unlock()
	if queued != 3 { // s1, s2 and c1 registered
		t.Fatalf("%d registration events queued, want 3", queued)
	}

	// And one whose asynchronous publish never went out (nil: as when PublishAsync failed): the confirming
	// flush publishes it.
	lost, err := events.New(testNode, events.EntitySecret, events.ActionRegistered,
		events.RefChange{Kind: events.KindSecret, Namespace: "ns", Name: "lost", Count: 1, PodUID: "uid-a", PodName: "a"})
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.pending = append(s.pending, pendingEvents{evs: []events.Event{lost}})
	s.mu.Unlock()

	if err := s.flush(t.Context(), false); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	left := len(s.pending)
	s.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d queued publishes left after a confirm-only flush", left)
	}
	if got := refEvents(t, b); len(got) != 4 || !contains(got, "secret.registered ns/lost") {
		t.Fatalf("registration events stored: %v, want 4 with ns/lost", got)
	}
	if s.flushedSeq() != 0 {
		t.Fatalf("a confirm-only flush moved the snapshot to %d", s.flushedSeq())
	}
	// A marker written to the bucket after the flush, on the connection the store writes with, reaches the
	// subscription after anything the flush wrote: once it is seen, so is every write of the flush.
	if _, err := s.store.kv.Put(t.Context(), events.NodeToken(testNode)+".marker", []byte("after the flush")); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the marker seen", func() bool { return w.marked() })
	if pods, applied := w.writes(); pods != 0 || len(applied) != 0 {
		t.Fatalf("a confirm-only flush wrote %d pod records and applied sequences %v", pods, applied)
	}

	if err := s.flushSnapshot(t.Context()); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the snapshot written", func() bool {
		pods, applied := w.writes()
		return pods == 2 && len(applied) == 1 && applied[0] == last
	})
}

// TestDeadLetterWritesTheSnapshotWhileCatchingUp: a dead letter forces a snapshot write even while the index
// is catching up (no FlushEvents or FlushMaxDelay write can come), so a crash after it does not dead-letter
// the same event again: the snapshot passes the dead letter's sequence long before the index catches up.
func TestDeadLetterWritesTheSnapshotWhileCatchingUp(t *testing.T) {
	b := startBus(t)
	pod := func(k, round int) *v1.Pod {
		return testPod("ns", fmt.Sprintf("p-%d", k), fmt.Sprintf("uid-%d", k), []string{"s"}, nil, fmt.Sprintf("img:%d", round))
	}
	batch := func(round int) []*v1.Pod {
		out := make([]*v1.Pod, 1000)
		for k := range out {
			out[k] = pod(k, round)
		}
		return out
	}
	publish(t, b, testNode, events.ActionAdded, batch(0)...)
	deadSeq, err := b.PublishMsgs(t.Context(), []bus.RawMsg{{
		Subject: events.EventSubject(testNode, events.EntityPod, events.ActionAdded), Data: []byte(`{"metadata":`)}})
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	for round := 1; round <= 20; round++ {
		last = publish(t, b, testNode, events.ActionUpdated, batch(round)...)
	}

	w := watchSnapshot(t, b)
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 10 * time.Millisecond,
		FlushEvents: 1 << 30, FlushMaxDelay: time.Hour})
	defer stop()
	bustest.WaitFor(t, "all applied", func() bool { return s.State().Applied() >= last })
	_, applied := w.writes()
	if len(applied) == 0 || applied[0] < deadSeq || applied[0] >= last-catchUpBacklog {
		t.Fatalf("applied sequences written %v; want the first at or after the dead letter %d and before the "+
			"index caught up (%d)", applied, deadSeq, last-catchUpBacklog)
	}
	t.Logf("dead letter at %d, first snapshot at %d, last event %d", deadSeq, applied[0], last)
}

// TestSayFlushError: while NATS is away every flush fails with "not connected", said once until a flush
// succeeds or fails otherwise; nothing is said while shutting down.
func TestSayFlushError(t *testing.T) {
	notConnected := fmt.Errorf("flush: %w", errNotConnected)
	other := errors.New("kv write: timeout")
	said := false
	for i, step := range []struct {
		err          error
		shuttingDown bool
		wantSay      bool
	}{
		{notConnected, false, true},
		{notConnected, false, false},
		{other, false, true},
		{notConnected, false, true}, // after another error, said again
		{notConnected, false, false},
		{nil, false, false},
		{notConnected, false, true}, // a new outage
		{other, true, false},        // shutting down
	} {
		var say bool
		say, said = sayFlushError(step.err, step.shuttingDown, said)
		if say != step.wantSay {
			t.Errorf("step %d (%v, shutting down %v): say = %v, want %v", i, step.err, step.shuttingDown, say, step.wantSay)
		}
	}
}

// TestCatchUpSurvivesEventsRemovedBeforeDelivery: the events counted when the tail started can be gone before
// they are delivered (expired, discarded at the stream's limits, purged); the count would then never drain
// and the queries would stay closed. A tail that stalls before catching up ends and the next one counts
// again, so the index opens its queries all the same.
func TestCatchUpSurvivesEventsRemovedBeforeDelivery(t *testing.T) {
	defer func(d time.Duration) { catchUpStall = d }(catchUpStall)
	catchUpStall = 200 * time.Millisecond
	srv, b := bustest.Start(t)
	const n = 60000
	batch := make([]*v1.Pod, 0, 1000)
	var last uint64
	for k := range n {
		batch = append(batch, testPod("ns", fmt.Sprintf("p-%d", k%5000), fmt.Sprintf("uid-%d", k%5000), []string{"s"}, nil, "img:1"))
		if len(batch) == cap(batch) {
			action := events.ActionAdded
			if k >= 5000 {
				action = events.ActionUpdated
			}
			last = publish(t, b, testNode, action, batch...)
			batch = batch[:0]
		}
	}
	// The server copies the events into the pods stream a little after it stores them: a purge before the copy
	// is done leaves the rest to be copied (and applied) after it, so every event could be applied (-race
	// under load: "applied every event (60000 of 60000) before the purge"). The copy is awaited first.
	bustest.WaitWithin(t, "every event copied into the pods stream", time.Minute, func() bool {
		info, err := b.Stream(t.Context(), events.PodsStream)
		return err == nil && info.LastSeq >= n
	})
	_, js := bustest.JetStream(t, srv)
	stream, err := js.Stream(t.Context(), events.PodsStream)
	if err != nil {
		t.Fatal(err)
	}

	s, err := New(Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	_, stop := runService(s)
	defer func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	}()
	// The events are purged while the applier is held (s.mu, which it takes for each event), so that it
	// cannot apply them all before the purge however the goroutines are scheduled: held once Run is past its
	// own use of s.mu at the start (lastWrite set), before the tail it then starts has applied anything, and
	// let go once the tail has counted the events and they are purged.
	var once sync.Once
	release := func() { once.Do(s.mu.Unlock) }
	bustest.WaitFor(t, "Run started (lastWrite set), then s.mu held", func() bool {
		s.mu.Lock()
		if s.lastWrite.IsZero() {
			s.mu.Unlock()
			return false
		}
		return true
	})
	defer release()
	bustest.WaitFor(t, "the tail to count the events to catch up", func() bool { return s.catchUpLeft.Load() > 0 })
	if err := stream.Purge(t.Context(), jetstream.WithPurgeSubject(events.PodEventSubjects(testNode))); err != nil {
		t.Fatal(err)
	}
	release()
	select {
	case <-s.Ready():
	case <-time.After(15 * time.Second):
		t.Fatalf("queries still closed 15s after the purge: %v", s.errCatchingUp())
	}
	applied := s.State().Applied()
	if applied >= last {
		t.Fatalf("applied every event (%d of %d) before the purge: the test did not remove any before delivery", applied, last)
	}
	t.Logf("applied %d of %d events, the rest purged before delivery", applied, last)
	if _, err := s.handleInUse(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
}
