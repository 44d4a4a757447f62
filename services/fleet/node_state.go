package fleet

import (
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// defaultLostAfterPeriods is how many heartbeat periods a node may miss before it is shown as lost.
const defaultLostAfterPeriods = 3

// DefaultHeartbeatPeriod is how often an agent heartbeats unless told otherwise.
const DefaultHeartbeatPeriod = 10 * time.Second

// nodeStatus computes a node's state from its last heartbeat (n, kept forever), whether its key is still in
// the TTL bucket (alive), and now. A node is Ready when its heartbeat key has not expired and its last
// heartbeat is at most lostAfter old (0: defaultLostAfterPeriods of the node's own period); otherwise it is
// Lost. The TTL is the server's clock, the age the node's: either one noticing silence is enough.
func nodeStatus(n events.NodeInfo, alive bool, now time.Time, lostAfter time.Duration) events.NodeStatus {
	limit := lostAfter
	if limit <= 0 {
		limit = time.Duration(defaultLostAfterPeriods) * n.Period.Duration
	}
	age := now.Sub(n.Heartbeat)
	if age < 0 {
		age = 0
	}
	st := events.NodeStatus{NodeInfo: n, State: events.NodeReady, Age: events.Duration{Duration: age}}
	if !alive || (limit > 0 && age > limit) {
		st.State = events.NodeLost
	}
	return st
}
