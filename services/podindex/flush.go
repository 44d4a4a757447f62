package podindex

// The snapshot: when it is written, and how (after the registration events are confirmed).

import (
	"context"
	"errors"
	"fmt"
	"time"
)

func (s *Service) requestFlush() {
	select {
	case s.flushNow <- struct{}{}:
	default:
	}
}

func (s *Service) flushLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.FlushInterval)
	defer tick.Stop()
	// While NATS is away every flush fails the same way: said once, until a flush succeeds or fails otherwise.
	saidNotConnected := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.flushNow:
		}
		err := s.flush(ctx, s.snapshotDue(time.Now()))
		var say bool
		if say, saidNotConnected = sayFlushError(err, ctx.Err() != nil, saidNotConnected); say {
			s.log.Warn("pod index flush failed", "err", err)
		}
	}
}

// sayFlushError decides whether a flush's error is logged: not when shutting down, and "not connected" only
// the first time in a row (NATS is away: every flush fails so until it is back). It returns whether this
// error is a "not connected" already said, for the next call.
func sayFlushError(err error, shuttingDown, saidNotConnected bool) (say, said bool) {
	notConnected := errors.Is(err, errNotConnected)
	return err != nil && !shuttingDown && !(notConnected && saidNotConnected), notConnected
}

// snapshotDue reports whether a flush at now writes the snapshot, or only confirms the registration events
// published since the last one (see Config.FlushEvents).
func (s *Service) snapshotDue(now time.Time) bool {
	s.mu.Lock()
	since, elapsed, forced := s.since, now.Sub(s.lastWrite), s.writeNow
	s.mu.Unlock()
	return snapshotPolicy{s.cfg.FlushInterval, s.cfg.FlushEvents, s.cfg.FlushMaxDelay}.due(
		s.backlog.Load(), since, elapsed, forced)
}

// snapshotPolicy decides when the snapshot is written.
type snapshotPolicy struct {
	interval time.Duration
	events   int
	maxDelay time.Duration
}

// due: always after a dead letter, after p.events events or p.maxDelay; and, while the index keeps up (a
// backlog of at most catchUpBacklog events), once p.interval passed (half of it, so a flush the ticker
// brings a little early still writes).
func (p snapshotPolicy) due(backlog uint64, since int, elapsed time.Duration, forced bool) bool {
	switch {
	case forced, since >= p.events, elapsed >= p.maxDelay:
		return true
	default:
		return backlog <= catchUpBacklog && elapsed >= p.interval/2
	}
}

var errNotConnected = errors.New("not connected to nats")

// Flush confirms the queued registration events, then writes the changed pods and the applied sequence.
func (s *Service) flushSnapshot(ctx context.Context) error { return s.flush(ctx, true) }

// flush confirms the queued registration events and, when write is set, writes the snapshot.
func (s *Service) flush(ctx context.Context, write bool) error {
	if s.store == nil {
		return nil // not running
	}
	if !s.refs.Connected() {
		// Acks cannot come: keep everything dirty for the next flush (or the replay after a restart).
		return fmt.Errorf("flush pod index of %s: %w", s.cfg.Node, errNotConnected)
	}
	s.mu.Lock()
	var d snapshotDelta
	var err error
	if write {
		d, err = s.state.takeDirty()
		s.since, s.writeNow = 0, false
	}
	pending := s.pending
	s.pending = nil
	s.mu.Unlock()
	if err != nil {
		return err
	}
	restore := func() {
		s.mu.Lock()
		s.pending = append(pending, s.pending...)
		s.writeNow = s.writeNow || write
		s.mu.Unlock()
		if write {
			s.state.redirty(d)
		}
	}
	for i, pe := range pending {
		if pe.p != nil && pe.p.Wait(ctx) == nil {
			continue
		}
		// Not confirmed: publish again (same ids, so stored once).
		if err := s.refs.PublishAll(ctx, pe.evs); err != nil {
			pending = pending[i:]
			restore()
			return fmt.Errorf("publish registration events: %w", err)
		}
	}
	pending = nil
	if !write || len(d.Puts)+len(d.Deletes) == 0 && d.Applied == s.flushedSeq() {
		return nil
	}
	if err := s.store.write(ctx, d); err != nil {
		restore()
		return err
	}
	s.setFlushed(d.Applied, time.Now())
	return nil
}

func (s *Service) flushedSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.flushed
}

func (s *Service) setFlushed(seq uint64, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushed, s.lastWrite = seq, at
}
