package fleet

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// NodeRequestID is the id of a rollout's request to node: <rollout id>.<node token>, or a hash of it when
// that is longer than a request id may be.
func NodeRequestID(rolloutID, node string) string {
	id := rolloutID + "." + events.NodeToken(node)
	if len(id) <= 128 {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return rolloutID + "." + hex.EncodeToString(sum[:16])
}

// PullRequestID is the pull request id a rollout uses for node (NodeRequestID). The work queue and the
// result events de-duplicate on it, so a retried publish is pulled and reported once.
func PullRequestID(rolloutID, node string) string { return NodeRequestID(rolloutID, node) }

// NewRolloutID returns a fresh rollout id: <kind>-<utc time>-<random>.
func NewRolloutID(kind string) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	if kind == "" {
		kind = "rollout"
	}
	return kind + "-" + time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}
