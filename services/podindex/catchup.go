package podindex

// Catching up: until the index has applied the events its stream held when it started, the queries answer
// that it is catching up.

import (
	"errors"
	"fmt"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// catchUpStall is how long the tail may deliver nothing before the index has caught up, before it counts
// again what is left (a variable for tests).
var catchUpStall = 2 * time.Second

// errRecount ends a tail that stalled before catching up: tailLoop starts the next one at once.
var errRecount = errors.New("recount the events left to catch up")

// countCaughtUp counts one handled event towards catching up: the index is caught up once it handled as
// many as its stream held when the tail started, or an event had none after it.
func (s *Service) countCaughtUp(pending uint64) {
	if s.caughtUp.Load() {
		return
	}
	// An event with none after it ends catching up, unless the pods stream was behind the events stream
	// when the tail started (it may not have copied the rest yet).
	if s.catchUpLeft.Add(-1) <= 0 || pending == 0 && !s.sourceBehind.Load() {
		s.markCaughtUp()
	}
}

// markCaughtUp opens the queries and closes Ready.
func (s *Service) markCaughtUp() {
	s.readyOnce.Do(func() {
		s.caughtUp.Store(true)
		pods, mirrors := s.state.Index.size()
		s.log.Info("pod index caught up", "pods", pods, "mirror_pods", mirrors, "applied_seq", s.state.Applied())
		close(s.ready)
	})
}

// errCatchingUp is the queries' answer before the index caught up.
func (s *Service) errCatchingUp() error {
	if s.caughtUp.Load() {
		return nil
	}
	return fmt.Errorf("%w (applied up to stream sequence %d, %d events to go)", events.ErrIndexCatchingUp,
		s.state.Applied(), max(s.catchUpLeft.Load(), 0))
}

// IsCatchingUp reports whether err is a query's answer from a pod index that has not caught up yet
// (events.ErrIndexCatchingUp, carried by the reply's error code).
func IsCatchingUp(err error) bool { return errors.Is(err, events.ErrIndexCatchingUp) }

// catchUpBacklog is the backlog (events after the last applied one) over which the index is catching up.
const catchUpBacklog = 1000
