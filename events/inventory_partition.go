package events

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
)

// The fleet inventory's input, partitioned. The server copies every image event of
// EventsStream into InventoryStream as it is stored, rewriting only the copy's subject to carry the node's
// partition in front: imagefleet.evt.<node>.image.<action> becomes
// imagefleet.inv.<partition>.<node>.image.<action>. The events stream and its subjects are untouched
// (subscribers keep filtering imagefleet.evt.<node>.image.>). Each partition has a durable consumer of its
// own (InventoryPartitionDurable), so the inventory's consumption is InventoryPartitions consumers whose
// leaders the cluster spreads over its servers, instead of the one shared InventoryDurable.
const (
	// InventoryStream is the partitioned copy of the image events, read only by the inventory. Work-queue
	// retention: a copy is removed once its partition's durable acked it, so the stream holds the
	// inventory's backlog, not a second history.
	InventoryStream = "IMAGEFLEET_INVENTORY"
	// InventoryPartitions is the number of partitions. Contract, as PullPartitions: the server's transform
	// and InventoryPartition must agree, so a change is a new stream and durables, never a setting.
	InventoryPartitions = 16
	// InventoryPartitionDurablePrefix starts each partition's durable: fleet-inventory-p00 .. -p15.
	InventoryPartitionDurablePrefix = InventoryDurable + "-p"
	// inventorySubjectPrefix starts the copies' subjects in InventoryStream.
	inventorySubjectPrefix = Prefix + ".inv"
)

// InventorySourceFilter is the subject filter, on EventsStream, of what InventoryStream copies: every
// node's image events (ImageEventsFilter).
const InventorySourceFilter = ImageEventsFilter

// InventorySourceTransform is the destination of the server's subject transform from InventorySourceFilter:
// the partition (nats-server's partition(n, 1): FNV-1a of the node token, mod n, as InventoryPartition) in
// front of the original subject's tokens after imagefleet.evt.
func InventorySourceTransform() string {
	return fmt.Sprintf("%s.{{partition(%d,1)}}.{{wildcard(1)}}.%s.>", inventorySubjectPrefix, InventoryPartitions, EntityImage)
}

// InventoryPartition is node's inventory partition: FNV-1a (32 bits) of its node token (NodeToken), mod
// InventoryPartitions. It is what the server's partition(16,1) transform computes from the subject's node
// token, so the inventory and the server agree without asking each other.
func InventoryPartition(node string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(NodeToken(node)))
	return int(h.Sum32() % InventoryPartitions)
}

// InventoryTokenPartition is InventoryPartition of the node whose token is token, without allocating (the
// partitioned inventory tells a bucket key's partition from its node token for every key it is shown).
func InventoryTokenPartition(token string) int {
	h := uint32(2166136261)
	for i := 0; i < len(token); i++ {
		h ^= uint32(token[i])
		h *= 16777619
	}
	return int(h % InventoryPartitions)
}

// InventoryPartitionDurable is partition p's durable consumer on InventoryStream: fleet-inventory-p<pp>.
func InventoryPartitionDurable(p int) string {
	return fmt.Sprintf("%s%02d", InventoryPartitionDurablePrefix, p)
}

// InventoryPartitionFilter is partition p's subject filter on InventoryStream: imagefleet.inv.<p>.> (the
// server writes the partition without padding). The filters of two partitions never overlap.
func InventoryPartitionFilter(p int) string { return fmt.Sprintf("%s.%d.>", inventorySubjectPrefix, p) }

// InventoryCopySubject is the subject InventoryStream stores node's image event under:
// imagefleet.inv.<partition>.<node token>.image.<action>.
func InventoryCopySubject(node, action string) string {
	return fmt.Sprintf("%s.%d.%s.%s.%s", inventorySubjectPrefix, InventoryPartition(node), NodeToken(node), EntityImage, action)
}

// SourceSequence reads the origin stream's sequence from a sourced message's Nats-Stream-Source header
// ("<stream> <sequence> ..."): the inventory guards its writes with the events stream's sequence, the same
// one an unpartitioned replica (on InventoryDurable) uses, whichever way an event reached it.
func SourceSequence(header, stream string) (uint64, error) {
	fields := strings.Fields(header)
	if len(fields) < 2 {
		return 0, fmt.Errorf("%w: stream source %q has no sequence", ErrMalformed, header)
	}
	// A stream sourced across JetStream domains is named "<stream>:<hash>"; the name before it is ours.
	if name, _, _ := strings.Cut(fields[0], ":"); name != stream {
		return 0, fmt.Errorf("%w: stream source %q is not %s", ErrMalformed, header, stream)
	}
	seq, err := strconv.ParseUint(fields[1], 10, 64)
	if err != nil || seq == 0 {
		return 0, fmt.Errorf("%w: stream source %q has no sequence", ErrMalformed, header)
	}
	return seq, nil
}
