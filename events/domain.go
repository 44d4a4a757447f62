package events

import (
	"fmt"
	"strings"
)

// A fleet may span several JetStream domains (docs/scale.md, leaf nodes): the hub's domain holds the
// fleet-wide state, and each leaf nats-server's own domain holds the pull work queues of the nodes
// connected to it. Every leaf stores its pull requests under the ordinary subjects (PullSubjects and the
// partitions), so a request for a node on a leaf cannot be published to them from the hub: every leaf would
// store it. A leaf's pull streams take DomainSubject(<leaf domain>, <their subjects>) as well, and turn it
// back into the ordinary subject as they store it, so a publisher elsewhere in the fleet addresses a node's
// request to the node's domain (NodeInfo.JSDomain) and it lands in that one leaf.

// DomainRoot is the subject root of messages addressed to one JetStream domain: imagefleet.domain.<domain>.
const DomainRoot = Prefix + ".domain"

// DomainSubject addresses subject, an imagefleet subject or filter (imagefleet.<rest>), to the JetStream
// domain domain: imagefleet.domain.<domain>.<rest>. An empty domain returns subject unchanged (the fleet's
// own domain).
func DomainSubject(domain, subject string) string {
	if domain == "" {
		return subject
	}
	return DomainRoot + "." + domain + "." + strings.TrimPrefix(subject, Prefix+".")
}

// ValidateDomain checks that a JetStream domain name is one subject token: what nats-server accepts as a
// domain and DomainSubject can carry.
func ValidateDomain(domain string) error {
	if domain == "" || strings.ContainsAny(domain, ".*> \t\r\n") {
		return fmt.Errorf("JetStream domain %q is not one subject token (no dots, wildcards or spaces)", domain)
	}
	return nil
}

// FleetWideStream reports whether stream (a key-value bucket's stream is KV_<bucket>) holds fleet-wide state,
// kept in the fleet's (the hub's) JetStream domain; every other stream and bucket lives in the domain of the
// server a node is connected to. The bus routes by it and the per-node permissions (deploy/natsconf) name
// each stream in its domain by it.
func FleetWideStream(stream string) bool {
	switch stream {
	case EventsStream, PodsStream, DeadLetterStream, RolloutStream,
		"KV_" + NodesBucket, "KV_" + NodesSeenBucket, "KV_" + InventoryBucket, "KV_" + InventoryOwnersBucket,
		"KV_" + GCPolicyBucket, "KV_" + GCCopiesBucket:
		return true
	}
	return false
}
