package podindex

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestGapWhenTheStreamDropsEvents: an index stops; while it is down the pods stream (here capped at
// 256 KiB) drops its oldest events, pod events of the node among them. The next index sees its next position
// below the stream's first: it counts a gap (metric, Gaps in pods replies, Health), where a fresh index and
// one that missed nothing count none.
func TestGapWhenTheStreamDropsEvents(t *testing.T) {
	srv := bustest.Server(t)
	b, err := bus.Connect(context.Background(), srv.ClientURL(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(context.Background(), bus.StreamsConfig{PodsMaxBytes: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	before := testutil.ToFloat64(eventGaps.WithLabelValues(testNode))
	s1, stop := startService(t, b, Config{Node: testNode})
	seq := publish(t, b, testNode, events.ActionAdded, testPod("ns", "first", "uid-first", nil, nil, "img:1"))
	bustest.WaitFor(t, "first pod applied", func() bool { return s1.state.Applied() >= seq })
	stop()
	if s1.Gaps() != 0 || s1.Health() != nil {
		t.Fatalf("a fresh index counted gaps: %d, %v", s1.Gaps(), s1.Health())
	}

	// An index that missed nothing counts no gap.
	s2, stop2 := startService(t, b, Config{Node: testNode})
	stop2()
	if s2.Gaps() != 0 {
		t.Fatalf("an index that missed nothing counted %d gaps", s2.Gaps())
	}

	// While no index runs, 2,000 pod events overflow the stream: the oldest are dropped unread.
	for i := range 20 {
		var pods []*v1.Pod
		for j := range 100 {
			pods = append(pods, testPod("ns", fmt.Sprintf("p-%d-%d", i, j), fmt.Sprintf("uid-%d-%d", i, j), nil, nil, "img:1"))
		}
		publish(t, b, testNode, events.ActionAdded, pods...)
	}
	info, err := b.Stream(context.Background(), events.PodsStream)
	if err != nil {
		t.Fatal(err)
	}
	if info.FirstSeq <= s1.state.Pos()+1 {
		t.Fatalf("the stream dropped nothing (first sequence %d): the test needs more events", info.FirstSeq)
	}
	s3, stop3 := startService(t, b, Config{Node: testNode})
	defer stop3()
	bustest.WaitFor(t, "gap counted", func() bool { return s3.Gaps() == 1 })
	if err := s3.Health(); err == nil {
		t.Fatal("healthy after a gap")
	} else {
		t.Logf("health: %v", err)
	}
	if got := testutil.ToFloat64(eventGaps.WithLabelValues(testNode)) - before; got != 1 {
		t.Fatalf("imagefleet_podindex_event_gaps_total grew by %v, want 1", got)
	}
	var rep events.PodsReply
	if err := b.Request(context.Background(), events.QuerySubject(testNode, events.QryPods), events.PodsQuery{Limit: 1}, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Gaps != 1 {
		t.Fatalf("pods reply gaps %d, want 1", rep.Gaps)
	}
}

// TestGapCountedOnce: a gap the index has not read past is counted once, however often it is found again
// and however far the stream drops on meanwhile (a restarted tail's start and the running tail's periodic
// check both look); a gap that starts past it is a new one. Before, the same gap found again after the
// stream dropped more counted twice (podsource's TestKubeletSourceRepairsAnIndexGap in CI: "index gaps 2,
// want 1").
func TestGapCountedOnce(t *testing.T) {
	srv := bustest.Server(t)
	b, err := bus.Connect(context.Background(), srv.ClientURL(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(context.Background(), bus.StreamsConfig{PodsMaxBytes: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	// overflow publishes pod events until the pods stream has dropped everything up to seq; it returns the
	// stream's first sequence.
	round := 0
	overflow := func(seq uint64) uint64 {
		t.Helper()
		for {
			info, err := b.Stream(context.Background(), events.PodsStream)
			if err != nil {
				t.Fatal(err)
			}
			if info.FirstSeq > seq {
				return info.FirstSeq
			}
			var pods []*v1.Pod
			for j := range 100 {
				pods = append(pods, testPod("ns", fmt.Sprintf("p-%d-%d", round, j), fmt.Sprintf("uid-%d-%d", round, j), nil, nil, "img:1"))
			}
			round++
			publish(t, b, testNode, events.ActionAdded, pods...)
			bustest.WaitFor(t, "the pods stream's copy", func() bool {
				info, err := b.Stream(context.Background(), events.PodsStream)
				return err == nil && info.LastSeq >= uint64(100*round)
			})
		}
	}
	const next = 2 // the index read the stream's first event, then stopped
	first := overflow(next)
	s.checkGap(t.Context(), events.PodsStream, next, &s.gapFirst)
	if s.Gaps() != 1 {
		t.Fatalf("gaps %d after the stream dropped events up to %d unread, want 1", s.Gaps(), first)
	}
	s.checkGap(t.Context(), events.PodsStream, next, &s.gapFirst)
	grown := overflow(first)
	s.checkGap(t.Context(), events.PodsStream, next, &s.gapFirst)
	if s.Gaps() != 1 {
		t.Fatalf("gaps %d after the same gap was found again, grown to %d, want 1", s.Gaps(), grown)
	}
	// The index reads on from the stream's first event; the stream then drops what follows it unread: a new
	// gap.
	overflow(grown)
	s.checkGap(t.Context(), events.PodsStream, grown+1, &s.gapFirst)
	if s.Gaps() != 2 {
		t.Fatalf("gaps %d after a second gap, want 2", s.Gaps())
	}
}
