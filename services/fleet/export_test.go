package fleet

import (
	"context"
	"sort"
	"strings"
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

// SelectNodes picks nodes by selector as Plan does over every node of the registry.
var SelectNodes = selectNodes

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

// NodeStates computes each node's state (nodeStatus) from its last heartbeat (seen), whether its key is
// still in the TTL bucket (alive), and now, sorted by node name.
func NodeStates(seen []events.NodeInfo, alive map[string]bool, now time.Time, lostAfter time.Duration) []events.NodeStatus {
	out := make([]events.NodeStatus, 0, len(seen))
	for _, n := range seen {
		out = append(out, nodeStatus(n, alive[n.Node], now, lostAfter))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	return out
}

// Beat sends one heartbeat now and returns it.
func (h *Heartbeat) Beat(ctx context.Context) (events.NodeInfo, error) {
	alive, seen, err := h.buckets(ctx)
	if err != nil {
		return events.NodeInfo{}, err
	}
	return h.beat(ctx, alive, seen)
}

// Answer computes an inventory reply from live placements, the oracle of the index and of the gathered
// parts (a pure function: where scans them all).
func Answer(q events.InventoryQuery, placements []events.Placement) (events.InventoryReply, error) {
	if q.What == events.InventoryWhere {
		m := newImageMatcher(q.Image)
		return answer(q, func(yield func(events.Placement)) {
			for _, p := range placements {
				if m.matches(p) {
					yield(p)
				}
			}
		})
	}
	return answer(q, func(yield func(events.Placement)) {
		for _, p := range placements {
			yield(p)
		}
	})
}

// matches reports whether p is an image m names: the scan Answer does, which the index's resolve answers
// by lookups.
func (m imageMatcher) matches(p events.Placement) bool {
	if p.ID == m.raw || (m.idPrefix != "" && strings.HasPrefix(p.ID, m.idPrefix)) {
		return true
	}
	for _, refs := range [][]string{p.RepoTags, p.RepoDigests} {
		for _, r := range refs {
			if r == m.raw || (m.normalized != "" && r == m.normalized) {
				return true
			}
		}
	}
	return false
}
