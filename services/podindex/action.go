package podindex

import "github.com/imagefleet/imagefleet/events"

// upsertAction is the action of an event that upserts a pod: updated when the index holds the pod (its UID)
// as far as the publisher knows, added when it does not. The two publishers of this package derive it here:
// podapply from the index itself (resolve), the static pod source from the index's listing at its start and
// what it published since (syncManifests). Applying an event does not look at it: added and updated are one
// upsert (State.Apply), and what changes is decided by what the index holds. The action is for the event's
// other readers (the puller pulls the images of an added pod) and the applied-events counter; the pod
// sources of services/podsource derive it the same way, in feed.diff (a worker does not import another).
func upsertAction(held bool) string {
	if held {
		return events.ActionUpdated
	}
	return events.ActionAdded
}
