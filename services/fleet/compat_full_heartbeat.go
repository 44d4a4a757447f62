// Compatibility path: the full heartbeat record in both buckets.
//
// An agent of the previous release writes its full record (it has Started) into the TTL bucket as well as
// the last-seen one, every period; an agent of this release writes a thin record there (heartbeat time and
// period). The registry reads either: a full record found in the TTL bucket is taken whole.
//
// Remove when: no agent before thin heartbeats runs (docs/upgrading.md, "Compatibility paths").

package fleet

import (
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// aliveRecord is what the TTL bucket says of a node: the thin heartbeat, or the previous release's full one.
type aliveRecord struct {
	heartbeat time.Time
	period    events.Duration
	full      *events.NodeInfo // the previous release's record (it has Started)
}

// newAliveRecord reads a node's record in the TTL bucket: a thin one, or the previous release's full one
// (it has Started), kept whole.
func newAliveRecord(n events.NodeInfo) aliveRecord {
	a := aliveRecord{heartbeat: n.Heartbeat, period: n.Period}
	if !n.Started.IsZero() {
		a.full = &n
	}
	return a
}

// thin reports whether the record is a thin heartbeat (the node's full record is in the last-seen bucket).
func (a aliveRecord) thin() bool { return a.full == nil }

// info is what the TTL bucket alone shows of node: its full record, or its thin one.
func (a aliveRecord) info(node string) events.NodeInfo {
	if a.full != nil {
		return *a.full
	}
	return events.NodeInfo{Node: node, Heartbeat: a.heartbeat, Period: a.period}
}

// mergeAlive brings a node's last-seen record up to its latest heartbeat.
func mergeAlive(seen events.NodeInfo, a aliveRecord) events.NodeInfo {
	if a.full != nil && !a.full.Heartbeat.Before(seen.Heartbeat) {
		return *a.full
	}
	if a.heartbeat.After(seen.Heartbeat) {
		seen.Heartbeat = a.heartbeat
		if a.period.Duration > 0 {
			seen.Period = a.period
		}
	}
	return seen
}
