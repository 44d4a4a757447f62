package fleet

import "time"

// SetGCAttemptTimeout sets how long GCAction waits for one answer before asking again (tests that lose
// replies with a server use a short one); the returned func restores it.
func SetGCAttemptTimeout(d time.Duration) (restore func()) {
	old := gcAttemptTimeout
	gcAttemptTimeout = d
	return func() { gcAttemptTimeout = old }
}

// StretchedPeriod is stretchedPeriod, the heartbeat's rate controller.
var StretchedPeriod = stretchedPeriod
