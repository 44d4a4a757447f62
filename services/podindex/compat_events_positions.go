package podindex

// Compatibility path: pod snapshots positioned in IMAGEFLEET_EVENTS (docs/upgrading.md, "Compatibility
// paths").
//
// Remove when: every node's snapshot has a pods-stream position (every agent ran once since)
//
// A release before the pods stream read the node's pod events from IMAGEFLEET_EVENTS: its snapshot has
// <node>.applied (an IMAGEFLEET_EVENTS sequence) and no <node>.pos. Such a snapshot loads with position 0
// (loadPos, State.Pos); the tail (tail.go) then reads the node's pod events of IMAGEFLEET_PODS from its
// start, skipping those up to the applied sequence, and asks IMAGEFLEET_EVENTS, not the pods stream, whether
// events after that sequence were dropped (eventsStreamGaps). The first snapshot written after that has a
// position, and the path is not taken again on that node.
//
// To remove: delete this file and the eventsStreamGaps field of Service, read <node>.pos with loadSeq in
// Store.load, and drop the events stream's gap check (a position of 0 with an applied sequence) from tail.go.

import (
	"context"
	"sync/atomic"
)

// eventsStreamGaps is the gap check's state for IMAGEFLEET_EVENTS, embedded in Service.
type eventsStreamGaps struct {
	// gapFirstEvents is gapFirst for the events stream, checked when a snapshot of an older release moves
	// over to the pods stream.
	gapFirstEvents atomic.Uint64
}

// loadPos reads <node>.pos: 0 when absent, as in a snapshot of a release that read IMAGEFLEET_EVENTS (or a
// new node's, which has no applied sequence either).
func (s *Store) loadPos(ctx context.Context) (uint64, error) {
	return s.loadSeq(ctx, s.posKey(), "pods stream position")
}
