package events

import (
	"fmt"
	"hash/fnv"
	"strings"
)

// The names below are the wire contract between the workers, the permissions of deploy/natsconf and the
// operators' tools, kept here so each is typed once. They are API: renaming a durable consumer redelivers its
// whole stream, renaming a bucket leaves its data behind, renaming a queue group splits replicas of two
// versions into two groups that both answer. testdata/names.golden pins every one; a rename fails
// TestNamesGolden. (The events and pods streams are in subject.go, the single pull queue of the older layout
// in compat_single_queue.go, the fleet's names in fleet.go.)

// Dead letters.
const (
	// DeadLetterStream keeps messages that were terminated or ran out of deliveries, for operators to list
	// and replay.
	DeadLetterStream = "IMAGEFLEET_DLQ"
	// DeadLetterPrefix is the subject root of dead letters: imagefleet.dlq.<stream>.<consumer>.
	DeadLetterPrefix = Prefix + ".dlq"
)

// Key-value buckets where each node owns the keys under its node token.
const (
	// RecordsBucket holds the image records the detector writes (its single writer) and the GC executor
	// reads; keys are RecordKey(node, image ID), so a per-node NATS permission on
	// $KV.imagefleet-records.<node token>.> reaches only that node's records.
	RecordsBucket = "imagefleet-records"
	// RecordsBucketDescription is the bucket's description; every opener passes the same one, since an
	// opener whose settings differ updates the bucket.
	RecordsBucketDescription = "image records per node"
	// PodsBucket holds the pod index's snapshots, one per node.
	PodsBucket = "imagefleet-pods"
	// PullBackoffBucket holds the puller's backoff per pod and image.
	PullBackoffBucket = "imagefleet-pull-backoff"
	// PullRecordsBucket holds the puller's KEP-2535 pulled-image records.
	PullRecordsBucket = "imagefleet-pull-records"
	// KubeEventsBucket holds the Kubernetes Events bridge's decided write (create or count patch, with its
	// body) per imagefleet event, keys <node token>.<event id>, so a redelivered event replays it.
	KubeEventsBucket = "imagefleet-kube-events"
)

// GCLeaseBucket holds each node's image GC pass lease, one key per node (its node token), with a TTL: the GC
// executor replica that creates the key runs the node's pass, renews the key while the pass runs and marks it
// released at its end; a holder that dies stops renewing and its key expires.
const GCLeaseBucket = "imagefleet-gc-lease"

// GCPolicyBucket holds each node's effective image GC policy (GCPolicy, JSON), one key per node (its node
// token): the fleet controller writes it from the ImageGCPolicy objects that select the node and deletes it
// when none does; the node's GC executor watches its own key and may not write it.
const GCPolicyBucket = "imagefleet-gc-policy"

// GCCopiesBucket is the keepCopies ledger of the fleet's copies arbiter: one key per image (its
// InventoryImageToken), holding the removals granted and not yet seen gone in the inventory, written under a
// compare-and-set so that two grants for one image never both count the same copies.
const GCCopiesBucket = "imagefleet-gc-copies"

// VerbGCPolicy is the command verb of GCPolicyNotice: the fleet controller announces on it, after each
// write of a node's key in GCPolicyBucket is stored, the key's new revision (a JSON number), so the node's
// GC executor reads its key within a round trip without holding a consumer of the bucket.
const VerbGCPolicy = "gcpolicy"

// GCPolicyNotice is the subject of node's GCPolicyBucket revision notices (VerbGCPolicy).
func GCPolicyNotice(node string) string { return CommandSubject(node, VerbGCPolicy) }

// CopiesQueue is the queue group of the copies arbiter's replicas (CopiesSubject).
const CopiesQueue = "fleet-copies"

// CopiesSubject is where node's GC executor asks the fleet which removals keepCopies allows:
// imagefleet.fleet.copies.<node token>.
func CopiesSubject(node string) string { return Prefix + ".fleet.copies." + NodeToken(node) }

// GCPolicyBucketDescription is GCPolicyBucket's description; every opener passes the same one, since an
// opener whose settings differ updates the bucket.
const GCPolicyBucketDescription = "effective ImageGCPolicy per node"

// Queue groups of the request/reply subjects: the replicas of a worker share its requests.
const (
	CacheQueue     = "cache"           // imagefleet.qry.<node>.images
	DetectorQueue  = "detector"        // imagefleet.cmd.<node>.detect, imagefleet.qry.<node>.records
	GCQueue        = "gc-executor"     // imagefleet.cmd.<node>.gc
	PodIndexQueue  = "pod-index"       // imagefleet.qry.<node>.pods, .refs, .inuse; imagefleet.cmd.<node>.podapply
	InventoryQueue = "fleet-inventory" // InventoryQuerySubject
)

// Durable consumers.
const (
	// PullerDurablePrefix starts the name of each node's pull consumer (PullerDurable).
	PullerDurablePrefix = "puller-"
	// InventoryDurable is the fleet inventory's consumer on EventsStream.
	InventoryDurable = "fleet-inventory"
	// KubeEventsDurablePrefix starts the name of each node's Kubernetes Events bridge consumer on
	// EventsStream (KubeEventsDurable).
	KubeEventsDurablePrefix = "kube-events-"
	// RemovalsDurablePrefix starts the name of each node's removals consumer on EventsStream (RemovalsDurable).
	RemovalsDurablePrefix = "removals-"
)

// RemovalsDurable is node's removals consumer on EventsStream (services/removals: images removed by another
// remover): "removals-" + node token, created with the node's events filter (NodeEvents).
func RemovalsDurable(node string) string { return RemovalsDurablePrefix + NodeToken(node) }

// KubeEventsDurable is node's Kubernetes Events bridge consumer on EventsStream: "kube-events-" + node token,
// created with the node's events filter (NodeEvents).
func KubeEventsDurable(node string) string { return KubeEventsDurablePrefix + NodeToken(node) }

// PullerDurable is node's pull consumer: "puller-" + node token, on its partition stream PullStreamOf(node)
// filtered to PullSubject(node), and, in the single queue of the older layout (compat_single_queue.go), on
// PullStream filtered to LegacyPullSubject(node). Its MaxAckPending is the node's pull-token limit.
func PullerDurable(node string) string { return PullerDurablePrefix + NodeToken(node) }

// PodIndexDeadLetters is the consumer name under which the pod index of node keeps the pod events it
// refused: imagefleet.dlq.IMAGEFLEET_EVENTS.pod-index-<node token>.
func PodIndexDeadLetters(node string) string { return PodIndexQueue + "-" + NodeToken(node) }

// RecordKey is the key of one image record in RecordsBucket: <node token>.<escaped image id>.
func RecordKey(node, imageID string) string { return NodeToken(node) + "." + EscapeKey(imageID) }

// RecordKeys is the key filter of every record of node in RecordsBucket.
func RecordKeys(node string) string { return NodeToken(node) + ".>" }

// EscapeKey turns an image ID into one KV key token: bytes outside [-_a-zA-Z0-9] become =XX (hex), so
// "sha256:ab" is "sha256=3Aab". Reversible and readable.
func EscapeKey(id string) string {
	var b strings.Builder
	for i := 0; i < len(id); i++ {
		c := id[i]
		if c == '-' || c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "=%02X", c)
	}
	return b.String()
}

// The pull work queue, partitioned: a node's pull requests go to one of PullPartitions work-queue streams,
// chosen by its name, so each stream holds the durable consumers of about 1/16 of the fleet, far below
// nats-server's limit of consumers per stream. The node token stays the subject's third token, so the
// per-node permissions on imagefleet.cmd.<node token>.> still hold.
const (
	// PullPartitions is the number of partition streams. It is part of the contract: every publisher and
	// every puller derives a node's partition from it, so a change moves nodes between streams (a new set of
	// streams and a migration, never a setting).
	PullPartitions = 16
	// PullPartitionStreamPrefix starts the name of each partition stream: IMAGEFLEET_PULL_00 .. _15.
	PullPartitionStreamPrefix = "IMAGEFLEET_PULL_"
	// PullPartitionMaxConsumers is each partition stream's MaxConsumers, set explicitly rather than left to
	// the server's default (1,000 per stream, or whatever the operator configured): 16 x 1,000 durables per
	// JetStream domain. Past that, a zone gets a leaf domain of its own (docs/scale.md).
	PullPartitionMaxConsumers = 1000
)

// SharedStreamMaxConsumers is the MaxConsumers of the streams every node holds a consumer of its own on:
// EventsStream (the removals worker's durable, the Kubernetes Events bridge's, short-lived ordered readers)
// and PodsStream (the pod index's ordered consumer of its node's pod events). nats-server counts every
// consumer, ordered ones too, against a default of 1,000 per stream, which a stream opts out of only with a
// positive limit of its own: about two per node for 16,000 nodes (the pull partitions' limit) with room for
// readers.
const SharedStreamMaxConsumers = 40000

// PullPartition is node's pull partition: FNV-1a (32 bits) of the node name, mod PullPartitions.
func PullPartition(node string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(node))
	return int(h.Sum32() % PullPartitions)
}

// PullPartitionStream is the name of partition p's stream: IMAGEFLEET_PULL_<pp>, two digits.
func PullPartitionStream(p int) string { return fmt.Sprintf("%s%02d", PullPartitionStreamPrefix, p) }

// PullPartitionSubjects is the subject filter of partition p's stream: imagefleet.cmd.*.pull.<pp>. The
// filters of two partitions never overlap, nor overlap the legacy PullSubjects.
func PullPartitionSubjects(p int) string {
	return fmt.Sprintf("%s.cmd.*.%s.%02d", Prefix, VerbPull, p)
}

// PullSubject is the subject of node's pull requests: imagefleet.cmd.<node token>.pull.<pp>, stored in
// PullStreamOf(node). Every publisher of pull requests uses it.
func PullSubject(node string) string {
	return fmt.Sprintf("%s.%02d", CommandSubject(node, VerbPull), PullPartition(node))
}

// PullStreamOf is the partition stream that holds node's pull requests and its PullerDurable consumer.
func PullStreamOf(node string) string { return PullPartitionStream(PullPartition(node)) }
