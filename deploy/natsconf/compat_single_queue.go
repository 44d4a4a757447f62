// Compatibility path: the single pull queue IMAGEFLEET_PULL (events.PullStream).
//
// Before the pull work queue was partitioned, each node's pull consumer (events.PullerDurable) was on one
// work-queue stream, filtered to events.LegacyPullSubject(node). Agents drain it during a rolling upgrade
// (services/puller/compat_single_queue.go), so a node identity keeps the rights on its durable there
// (NodePermissions).
//
// Remove when: no supported release publishes to the single queue (the release after the partitioned
// queue's next; docs/upgrading.md, "Compatibility paths").

package natsconf

import "github.com/imagefleet/imagefleet/events"

// legacyPullPermissions are node's rights on its durable on the single pull queue, which agents drain during
// an upgrade (info, fetch, ack). Create stays allowed with the node's own filter only, so an agent of the
// single-queue layout run with credentials made by this one still opens its consumer.
func legacyPullPermissions(node string) []string {
	durable, filter := events.PullerDurable(node), events.LegacyPullSubject(node)
	return []string{
		"$JS.API.CONSUMER.CREATE." + events.PullStream + "." + durable + "." + filter,
		"$JS.API.CONSUMER.INFO." + events.PullStream + "." + durable,
		"$JS.API.CONSUMER.MSG.NEXT." + events.PullStream + "." + durable,
		"$JS.ACK." + events.PullStream + "." + durable + ".>",
	}
}
