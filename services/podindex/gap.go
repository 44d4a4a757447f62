package podindex

// Gaps: pod events the pods stream (or the events stream, compat_events_positions.go) dropped before the
// index read them.

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// gapHealth is how long /healthz reports a gap: the kubelet pod source's periodic reconcile (5 min)
// repairs it within that time (the API server source's too), and both at once when they see the
// gap count of a pods reply change.
const gapHealth = 5 * time.Minute

// gapCheckPeriod is how often a running tail compares its position with the stream's first sequence.
var gapCheckPeriod = 10 * time.Second

// checkGap compares next, the sequence of stream the index reads next, with the stream's first sequence.
// The pods stream (its own limits, pod events of every node) drops its oldest events when full or old; if
// it dropped some the index had yet to read, some may have been this node's pod events. A fresh index (next
// 1) reads whatever the stream still holds and has no gap to report.
//
// A gap is counted once. reported keeps the end of the last gap reported for that stream (the stream's
// first sequence then); while the index has not read past it (next below it), the stream dropping more
// events only makes that same gap longer: the check at the next tail's start, or the running tail's
// periodic one, found it again and counted it twice (podsource's TestKubeletSourceRepairsAnIndexGap in
// CI: "index gaps 2, want 1"). Its end moves on; a new gap is one that starts past it.
func (s *Service) checkGap(ctx context.Context, stream string, next uint64, reported *atomic.Uint64) {
	if next <= 1 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info, err := s.bus.Stream(ctx, stream)
	if err != nil || info.FirstSeq <= next {
		return
	}
	last := reported.Load()
	if last >= info.FirstSeq {
		return // already reported
	}
	reported.Store(info.FirstSeq)
	if next < last {
		return // the gap already reported, grown
	}
	s.gaps.Add(1)
	s.gapAt.Store(time.Now().UnixNano())
	eventGaps.WithLabelValues(s.cfg.Node).Inc()
	s.log.Error("pod events may be lost: the stream dropped events before the pod index read them; the pod sources reconcile with the index",
		"stream", stream, "next_seq", next, "stream_first_seq", info.FirstSeq, "dropped", info.FirstSeq-next)
}

// gapLost reports n of the node's pod events dropped from the stream between the last delivered one (at
// after) and the one at seq (the consumer's pending count fell by more than the delivery), unless checkGap
// reported that gap already (its reported end is past after+1: the stream's first sequence had moved past
// the index's position while the index waited for seq).
func (s *Service) gapLost(after, seq, n uint64) {
	if s.gapFirst.Load() > after+1 {
		return
	}
	s.gaps.Add(1)
	s.gapAt.Store(time.Now().UnixNano())
	eventGaps.WithLabelValues(s.cfg.Node).Inc()
	s.log.Error("pod events lost: the pods stream dropped them before the pod index read them; the pod sources reconcile with the index",
		"lost", n, "before_pods_stream_seq", seq)
}

// Gaps is how many gaps the index has seen since it started (PodsReply.Gaps).
func (s *Service) Gaps() uint64 { return s.gaps.Load() }

// Health is an error for gapHealth after a gap, else nil (/healthz).
func (s *Service) Health() error {
	at := s.gapAt.Load()
	if at == 0 || time.Since(time.Unix(0, at)) > gapHealth {
		return nil
	}
	return fmt.Errorf("pod index: pod events may have been lost at %s (the events stream dropped them before the index read them); the pod sources reconcile",
		time.Unix(0, at).UTC().Format(time.RFC3339))
}
