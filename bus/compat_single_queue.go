// Compatibility path: the single pull queue IMAGEFLEET_PULL (events.PullStream).
//
// Before the pull work queue was partitioned, every node's pull requests went to one work-queue stream.
// EnsureStreams still creates it, so that CLIs and orchestrators of that layout can still queue pulls during
// a rolling upgrade (new agents drain it: services/puller/compat_single_queue.go; docs/operations.md); an
// operator removes it once it is empty (`imagefleet bus remove-legacy-pull`, DeleteStream), and the next
// EnsureStreams makes it again, empty and without consumers. On a leaf's JetStream domain it is a pull queue
// like the partitions (isPullStream, inDomain).
//
// Remove when: no supported release publishes to the single queue (the release after the partitioned
// queue's next; docs/upgrading.md, "Compatibility paths").

package bus

import (
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// legacyPullStreamConfig is the single pull queue of the older layout, with replicas.
func legacyPullStreamConfig(replicas int) jetstream.StreamConfig {
	return pullStreamConfig(events.PullStream, events.PullSubjects, 0, replicas,
		"image pull commands, one work queue consumer per node (legacy: see "+events.PullPartitionStreamPrefix+"<pp>)")
}

// isLegacyPullStream reports whether stream is the single pull queue.
func isLegacyPullStream(stream string) bool { return stream == events.PullStream }
