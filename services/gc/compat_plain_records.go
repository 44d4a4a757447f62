// Compatibility path: a detector without WithRecords.
//
// The GC executor asks the detector to detect with events.DetectRequest.WithRecords, so the reply carries
// the node's records. A detector of the layout before WithRecords refuses the field as unknown
// (events.ErrMalformed) and detects nothing: the executor then asks it again without the field, lists the
// records bucket as with any reply without a list, and asks without WithRecords for plainFor (a rolling
// upgrade replaces the detector within minutes).
//
// Remove when: every detector answers WithRecords (docs/upgrading.md, "Compatibility paths").

package gc

import (
	"context"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// plainFor is how long busRecords asks without WithRecords after a detector refused it (a rolling upgrade
// replaces it within minutes).
const plainFor = 10 * time.Minute

// plainDetector is busRecords' memory of a detector that refused WithRecords, guarded by busRecords.mu.
type plainDetector struct {
	// plainUntil: a detector refused WithRecords; ask without it until then.
	plainUntil time.Time
}

// withRecords reports whether to ask with WithRecords: not until plainUntil.
func (r *busRecords) withRecords() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return time.Now().After(r.plainUntil)
}

// detectPlain asks again without WithRecords after the detector refused it (events.ErrMalformed): a detector
// that does not know WithRecords detected nothing. It asks without it for plainFor from now.
func (r *busRecords) detectPlain(ctx context.Context, at time.Time) (events.DetectReply, error) {
	r.mu.Lock()
	r.plainUntil = time.Now().Add(plainFor)
	r.mu.Unlock()
	var rep events.DetectReply
	err := r.bus.Request(ctx, events.CommandSubject(r.node, events.VerbDetect), events.DetectRequest{Time: &at}, &rep)
	return rep, err
}
