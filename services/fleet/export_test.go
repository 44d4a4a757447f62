package fleet

import (
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// SetGCAttemptTimeout sets how long GCAction waits for one answer before asking again (tests that lose
// replies with a server use a short one); the returned func restores it.
func SetGCAttemptTimeout(d time.Duration) (restore func()) {
	old := gcAttemptTimeout
	gcAttemptTimeout = d
	return func() { gcAttemptTimeout = old }
}

// StretchedPeriod is stretchedPeriod, the heartbeat's rate controller.
var StretchedPeriod = stretchedPeriod

// Indexed counts the live placements in the index, and those of them in a partition the replica does not
// own (partitioned: none should be).
func (s *Inventory) Indexed() (n, foreign int) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, nodes := range s.index {
		for node, p := range nodes {
			if p.Gone {
				continue
			}
			n++
			if s.cfg.Partitioned && s.own[events.InventoryTokenPartition(node)] != partReady {
				foreign++
			}
		}
	}
	return n, foreign
}

// MergeParts is mergeParts.
var MergeParts = mergeParts
