// Compatibility path: the single pull queue IMAGEFLEET_PULL.
//
// Before the pull work queue was partitioned (PullPartitionStream), every node's pull requests went to one
// work-queue stream, PullStream, on LegacyPullSubject(node) = imagefleet.cmd.<node token>.pull, with the
// node's PullerDurable on it filtered to that subject. A CLI or orchestrator of that layout still publishes
// there during a rolling upgrade: the stream is kept and still created (bus/compat_single_queue.go), agents
// drain their durable on it (services/puller/compat_single_queue.go) with the permissions to do so
// (deploy/natsconf/compat_single_queue.go), and an operator removes it once it is empty
// (cmd/imagefleet/compat_single_queue.go, `imagefleet bus remove-legacy-pull`).
//
// Remove when: no supported release publishes to the single queue (the release after the partitioned
// queue's next; docs/upgrading.md, "Compatibility paths").

package events

const (
	// PullStream is the legacy JetStream work-queue stream for pull commands (imagefleet.cmd.<node>.pull),
	// one durable consumer per node, which nats-server caps at 1,000 per stream. Pull requests now go to the
	// partition streams (PullPartitionStream); this one is kept, and still created, so that requests
	// published by a CLI or orchestrator of the single-queue layout are drained by the new agents during a
	// rolling upgrade (docs/upgrading.md, "The partitioned pull queue").
	PullStream = "IMAGEFLEET_PULL"
	// PullSubjects is the subject filter of the legacy PullStream.
	PullSubjects = Prefix + ".cmd.*.pull"
)

// LegacyPullSubject is the subject of node's pull requests in the legacy PullStream (imagefleet.cmd.<node
// token>.pull), where a CLI or orchestrator of the single-queue layout still publishes during an upgrade.
func LegacyPullSubject(node string) string { return CommandSubject(node, VerbPull) }
