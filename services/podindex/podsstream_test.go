package podindex

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// streamsBus starts a server and a connection with the streams sized by cfg.
func streamsBus(t *testing.T, cfg bus.StreamsConfig) *bus.Bus {
	t.Helper()
	srv := bustest.Server(t)
	b, err := bus.Connect(context.Background(), srv.ClientURL(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	return b
}

// flood publishes other events of other nodes until the events stream's first sequence is past seq.
func flood(t *testing.T, b *bus.Bus, seq uint64) {
	t.Helper()
	body := []byte(`{"pad":"` + strings.Repeat("x", 1000) + `"}`)
	for i := 0; ; i++ {
		info, err := b.Stream(context.Background(), events.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		if info.FirstSeq > seq {
			return
		}
		if i > 100 {
			t.Fatalf("the events stream still holds sequence %d (first %d)", seq, info.FirstSeq)
		}
		msgs := make([]bus.RawMsg, 100)
		for k := range msgs {
			msgs[k] = bus.RawMsg{Subject: events.EventSubject(fmt.Sprintf("other-%d", k%7), "image", "pulled"), Data: body}
		}
		if _, err := b.PublishMsgs(context.Background(), msgs); err != nil {
			t.Fatal(err)
		}
	}
}

// podUIDs is the UIDs of the pods s indexes.
func podUIDs(s *Service) map[string]bool {
	out := map[string]bool{}
	for _, p := range s.State().Index.getPods() {
		out[string(p.UID)] = true
	}
	return out
}

// TestPodEventsOutliveAFloodOfOtherEvents: while the index is down, other events (of other nodes) push the
// node's pod events out of the events stream (here capped at 256 KiB). The index reads every one of them
// all the same, from the pods stream, and counts no gap.
func TestPodEventsOutliveAFloodOfOtherEvents(t *testing.T) {
	b := streamsBus(t, bus.StreamsConfig{EventsMaxBytes: 256 << 10})
	s1, stop1 := startService(t, b, Config{Node: testNode})
	seq := publish(t, b, testNode, events.ActionAdded, testPod("ns", "first", "uid-first", nil, nil, "img:1"))
	bustest.WaitFor(t, "first pod applied", func() bool { return s1.state.Applied() >= seq })
	stop1()

	var pods []*v1.Pod
	for k := range 100 {
		pods = append(pods, testPod("ns", fmt.Sprintf("p-%d", k), fmt.Sprintf("uid-%d", k), nil, nil, "img:1"))
	}
	last := publish(t, b, testNode, events.ActionAdded, pods...)
	last = max(last, publish(t, b, testNode, events.ActionDeleted, pods[0]))
	// The pods stream copies pod events from the events stream as the server gets to it (a source): the
	// flood comes once the copy holds all 102, as any events stream but this test's 256 KiB one would
	// hold them for longer than the copy takes.
	bustest.WaitFor(t, "the pods stream holding the 102 pod events", func() bool {
		info, err := b.Stream(t.Context(), events.PodsStream)
		return err == nil && info.Messages >= uint64(len(pods)+2)
	})
	flood(t, b, last)

	s2, stop2 := startService(t, b, Config{Node: testNode})
	defer stop2()
	// Ready: caught up with every pod event its stream held at the start.
	got := podUIDs(s2)
	if len(got) != 100 || !got["uid-first"] || got["uid-0"] || !got["uid-99"] {
		t.Fatalf("indexed %d pods (first %v, deleted uid-0 %v, last %v), want 100: pod events lost to the flood",
			len(got), got["uid-first"], got["uid-0"], got["uid-99"])
	}
	if s2.state.Applied() < last {
		t.Fatalf("ready at %d, before the last pod event %d", s2.state.Applied(), last)
	}
	if s2.Gaps() != 0 {
		t.Fatalf("counted %d gaps, want none", s2.Gaps())
	}
}

// TestSnapshotOfTheEventsStreamMovesOver: an index of an older release kept its position as an events
// stream sequence only (no pods stream position). The next index reads the pods stream from its start,
// skips what the snapshot holds and applies the rest once: no pod lost, no event applied twice.
func TestSnapshotOfTheEventsStreamMovesOver(t *testing.T) {
	b := streamsBus(t, bus.StreamsConfig{})
	var pods []*v1.Pod
	for k := range 50 {
		pods = append(pods, testPod("ns", fmt.Sprintf("p-%d", k), fmt.Sprintf("uid-%d", k), []string{fmt.Sprintf("s-%d", k)}, nil, "img:1"))
	}
	s1, stop1 := startService(t, b, Config{Node: testNode})
	seq := publish(t, b, testNode, events.ActionAdded, pods...)
	bustest.WaitFor(t, "pods applied", func() bool { return s1.state.Applied() >= seq })
	stop1() // the final flush writes the snapshot
	store, err := OpenStore(t.Context(), b, testNode)
	if err != nil {
		t.Fatal(err)
	}
	_, applied, pos, _, err := store.load(t.Context())
	if err != nil || applied != seq || pos == 0 {
		t.Fatalf("snapshot at %d (pods stream %d), %v; want %d", applied, pos, err, seq)
	}
	// What an older release leaves: the applied sequence, no position.
	if err := store.kv.Delete(t.Context(), store.posKey()); err != nil {
		t.Fatal(err)
	}

	// While it is down: 10 pods deleted, 10 updated, 10 added.
	publish(t, b, testNode, events.ActionDeleted, pods[:10]...)
	for _, p := range pods[10:20] {
		p.Spec.Containers[0].Image = "img:2"
	}
	publish(t, b, testNode, events.ActionUpdated, pods[10:20]...)
	var added []*v1.Pod
	for k := range 10 {
		added = append(added, testPod("ns", fmt.Sprintf("n-%d", k), fmt.Sprintf("new-%d", k), nil, nil, "img:3"))
	}
	last := publish(t, b, testNode, events.ActionAdded, added...)

	appliedBefore := map[string]float64{}
	for _, a := range []string{events.ActionAdded, events.ActionUpdated, events.ActionDeleted} {
		appliedBefore[a] = testutil.ToFloat64(eventsApplied.WithLabelValues(testNode, a))
	}
	s2, stop2 := startService(t, b, Config{Node: testNode})
	defer stop2()
	bustest.WaitFor(t, "every event applied", func() bool { return s2.state.Applied() >= last })
	for a, want := range map[string]float64{events.ActionAdded: 10, events.ActionUpdated: 10, events.ActionDeleted: 10} {
		if got := testutil.ToFloat64(eventsApplied.WithLabelValues(testNode, a)) - appliedBefore[a]; got != want {
			t.Errorf("%s events applied %v, want %v (the snapshot's events applied again, or some skipped)", a, got, want)
		}
	}
	got := podUIDs(s2)
	if len(got) != 50 {
		t.Errorf("indexed %d pods, want 50", len(got))
	}
	for k := range 50 {
		if want := k >= 10; got[fmt.Sprintf("uid-%d", k)] != want {
			t.Errorf("uid-%d indexed %v, want %v", k, !want, want)
		}
	}
	for k := range 10 {
		if !got[fmt.Sprintf("new-%d", k)] {
			t.Errorf("new-%d not indexed", k)
		}
		if p, ok := s2.State().Index.getPodByUID(pods[10+k].UID); !ok || p.Spec.Containers[0].Image != "img:2" {
			t.Errorf("%s not at its update", pods[10+k].UID)
		}
	}
	if s2.Gaps() != 0 {
		t.Errorf("counted %d gaps moving over, want none", s2.Gaps())
	}
	if n := len(s2.state.Refs.Refs()); n != 40 {
		t.Errorf("%d secrets referenced, want 40", n)
	}
	// The next snapshot has a position in the pods stream.
	if err := s2.flushSnapshot(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, _, pos, _, err := store.load(t.Context()); err != nil || pos == 0 {
		t.Fatalf("pods stream position %d after the move, %v", pos, err)
	}
}
