package natsconf

import (
	"github.com/imagefleet/imagefleet/events"
)

// Roles of the identities in the generated config.
const (
	RoleNode      = "node"
	RoleFleet     = "fleet"
	RoleInventory = "inventory"
	RoleAdmin     = "admin"
	// RoleSite is a leaf site's server: the identity its leaf connection to the hub authenticates with.
	RoleSite = "site"
)

// NodeBuckets are the key-value buckets where each node owns the keys under its node token. The names, like
// every name the permissions refer to, are the workers' own, from events.
var NodeBuckets = []string{
	events.RecordsBucket,     // detector: image records
	events.PodsBucket,        // pod index snapshots
	events.PullBackoffBucket, // puller: backoff per pod and image
	events.PullRecordsBucket, // puller: KEP-2535 pulled records
	events.KubeEventsBucket,  // kube-events bridge: the Event write decided per event
}

// NodeKeyBuckets are buckets where a node owns exactly one key, its node token (heartbeats).
var NodeKeyBuckets = []string{events.NodesBucket, events.NodesSeenBucket}

// NodeLeaseBuckets are buckets where a node owns exactly one key, its node token, that only the node reads
// and writes (the GC pass lease): unlike NodeKeyBuckets the fleet does not read them.
var NodeLeaseBuckets = []string{events.GCLeaseBucket}

// NodeReadBuckets are buckets where a node reads exactly one key, its node token, and writes nothing: the
// fleet controller writes them (the node's effective ImageGCPolicy).
var NodeReadBuckets = []string{events.GCPolicyBucket}

// Permissions of one user: what it may publish and subscribe to. AllowResponses lets it answer requests
// (publish once to the reply subject of a request it received) without a publish permission on inboxes.
type Permissions struct {
	Publish        []string
	Subscribe      []string
	AllowResponses bool
	// Deny is refused both ways even where Publish or Subscribe allow it.
	Deny []string
}

// inbox is the reply-subject root of the user with public key pub (bus.InboxRoot + "." + pub): bus.Connect
// uses it for clients authenticated with an nkey.
func inbox(pub string) string { return "_INBOX." + pub + ".>" }

// NodePermissions are the permissions of node's agent (every node worker: detector, cache, gc, puller,
// pod index, heartbeat) authenticated with the nkey whose public key is pub, on a server of JetStream domain
// hub (the fleet's); with hub "" the node is on the fleet's own servers.
//
// A node may publish its own events, answer requests to its own commands and queries (and ask them itself:
// gc asks the pod index which images are in use), use the JetStream API for its own pull consumer only
// (the consumer-create subject carries the filter, so it cannot be created over another node's commands),
// write and read its own keys in the node buckets, and read its own events back (the pod index's ordered
// consumer, filtered to its node). It may not create, change or delete streams, buckets or other consumers:
// an operator (the admin user) creates them.
//
// On a leaf site (hub set: the node's server is a leaf with a JetStream domain of its own, docs/operations.md
// "Leaf nodes") each right is granted in the one domain that holds its stream or bucket
// (events.FleetWideStream), as the bus addresses it: the events and pods streams and the heartbeat buckets
// through the hub's API ($JS.<hub>.API..., key-value writes to $JS.<hub>.API.$KV.<bucket>.<key>, since a
// plain $KV subject does not cross into another domain), the pull queues and the node buckets through the
// leaf's own ($JS.API..., $KV...). Nothing is granted in the other domain, nor in any third one.
func NodePermissions(node, pub, hub string) Permissions {
	t := events.NodeToken(node)
	durable := events.PullerDurable(node)
	pullStream, pullFilter := events.PullStreamOf(node), events.PullSubject(node)
	// api is the JetStream API prefix of stream's domain; kv the subject prefix of a write to bucket.
	api := func(stream string) string {
		if hub != "" && events.FleetWideStream(stream) {
			return "$JS." + hub + ".API."
		}
		return "$JS.API."
	}
	kv := func(bucket string) string {
		if hub != "" && events.FleetWideStream("KV_"+bucket) {
			return "$JS." + hub + ".API.$KV." + bucket + "."
		}
		return "$KV." + bucket + "."
	}
	pub1 := []string{
		events.Prefix + ".evt." + t + ".>",
		events.Prefix + ".cmd." + t + ".>",
		events.Prefix + ".qry." + t + ".>",
		"$JS.API.INFO",
		"$JS.API.STREAM.INFO.*",
		// The node's pull consumer on its partition stream: create (only with its own filter), info, fetch,
		// ack. Not on any other partition, nor under another name.
		"$JS.API.CONSUMER.CREATE." + pullStream + "." + durable + "." + pullFilter,
		"$JS.API.CONSUMER.INFO." + pullStream + "." + durable,
		"$JS.API.CONSUMER.MSG.NEXT." + pullStream + "." + durable,
		"$JS.ACK." + pullStream + "." + durable + ".>",
	}
	// The same durable on the single pull queue of the older layout (compat_single_queue.go).
	pub1 = append(pub1, legacyPullPermissions(node)...)
	pub1 = append(pub1, []string{
		// Reading its own events back (ordered consumers, filtered to the node).
		api(events.EventsStream) + "CONSUMER.CREATE." + events.EventsStream + ".*." + events.NodeEvents(node),
		api(events.EventsStream) + "CONSUMER.MSG.NEXT." + events.EventsStream + ".*",
		api(events.EventsStream) + "CONSUMER.INFO." + events.EventsStream + ".*",
		// The pod index's ordered consumer of the node's pod events in the pods stream, and nothing else there.
		api(events.PodsStream) + "CONSUMER.CREATE." + events.PodsStream + ".*." + events.PodEventSubjects(node),
		api(events.PodsStream) + "CONSUMER.MSG.NEXT." + events.PodsStream + ".*",
		api(events.PodsStream) + "CONSUMER.INFO." + events.PodsStream + ".*",
		// The Kubernetes Events bridge's durable consumer of the node's events (created with the filter above).
		"$JS.ACK." + events.EventsStream + "." + events.KubeEventsDurable(node) + ".>",
		// The removals worker's durable consumer of the node's events (images removed by another remover).
		"$JS.ACK." + events.EventsStream + "." + events.RemovalsDurable(node) + ".>",
		// Dead letters of the node's consumers (bus.Consume keeps terminated messages there).
		events.DeadLetterPrefix + ".>",
		// Asking the fleet's copies arbiter which removals keepCopies allows, under its own name only.
		events.CopiesSubject(node),
	}...)
	if hub != "" {
		// The fleet-wide streams' and buckets' info (the bus reads a stream's info before using it).
		pub1 = append(pub1, "$JS."+hub+".API.INFO", "$JS."+hub+".API.STREAM.INFO.*")
	}
	for _, b := range NodeBuckets {
		pub1 = append(pub1,
			kv(b)+t+".>",
			api("KV_"+b)+"DIRECT.GET.KV_"+b+".$KV."+b+"."+t+".>",
			api("KV_"+b)+"CONSUMER.CREATE.KV_"+b+".*.$KV."+b+"."+t+".>",
			api("KV_"+b)+"CONSUMER.MSG.NEXT.KV_"+b+".*",
			// A list or watch ends by deleting its ordered consumer (else the server keeps it until it is
			// inactive, and the client waits out an API timeout). Only ordered consumers live on these streams.
			api("KV_"+b)+"CONSUMER.DELETE.KV_"+b+".*",
		)
	}
	// Its own key in the key buckets: create, compare-and-set updates and deletes are publishes to the key's
	// subject (with expected-revision headers the server checks), reads a direct get of that key only.
	for _, b := range append(append([]string{}, NodeKeyBuckets...), NodeLeaseBuckets...) {
		pub1 = append(pub1, kv(b)+t, api("KV_"+b)+"DIRECT.GET.KV_"+b+".$KV."+b+"."+t)
	}
	// Its own key in the read-only buckets: a direct get of that key (the writer announces each revision on
	// the node's command subjects, which it subscribes to below).
	for _, b := range NodeReadBuckets {
		pub1 = append(pub1, api("KV_"+b)+"DIRECT.GET.KV_"+b+".$KV."+b+"."+t)
		// The watch of an agent of the earlier delivery (compat_policy_watch.go).
		pub1 = append(pub1, legacyPolicyWatchPermissions(api("KV_"+b), b, t)...)
	}
	return Permissions{
		Publish: pub1,
		Subscribe: []string{
			// Its own events: the puller follows pod deletions of its node as they are published.
			events.Prefix + ".evt." + t + ".>",
			events.Prefix + ".cmd." + t + ".>",
			events.Prefix + ".qry." + t + ".>",
			inbox(pub),
		},
		AllowResponses: true,
	}
}

// FleetPermissions are the fleet orchestrator's: it commands and queries every node (waves of GC and
// pre-pulls), reads the node registry and the inventory, and owns the rollout stream and the fleet
// subjects. It may not publish node events nor write node state.
func FleetPermissions(pub string) Permissions {
	p := []string{
		events.Prefix + ".cmd.>",
		events.Prefix + ".qry.>",
		events.Prefix + ".fleet.>",
		// Commands addressed to a node's leaf domain (pull requests: events.DomainSubject).
		events.DomainRoot + ".*.cmd.>",
		"$JS.API.INFO",
		"$JS.API.STREAM.INFO.*",
		"$JS.API.STREAM.CREATE." + events.RolloutStream,
		"$JS.API.STREAM.UPDATE." + events.RolloutStream,
		"$JS.API.CONSUMER.*." + events.RolloutStream + ".>",
		"$JS.ACK." + events.RolloutStream + ".>",
		"$JS.API.STREAM.MSG.GET." + events.RolloutStream,
		// Reading events (results of the waves) through ordered consumers.
		"$JS.API.CONSUMER.CREATE." + events.EventsStream + ".>",
		"$JS.API.CONSUMER.MSG.NEXT." + events.EventsStream + ".*",
		"$JS.API.CONSUMER.INFO." + events.EventsStream + ".*",
	}
	for _, b := range append(append([]string{}, NodeKeyBuckets...), events.InventoryBucket) {
		p = append(p,
			"$JS.API.DIRECT.GET.KV_"+b+".>",
			"$JS.API.CONSUMER.CREATE.KV_"+b+".>",
			"$JS.API.CONSUMER.MSG.NEXT.KV_"+b+".*",
			// A list or watch ends by deleting its ordered consumer (else the server keeps it until it is
			// inactive, and the client waits out an API timeout). Only ordered consumers live on these streams.
			"$JS.API.CONSUMER.DELETE.KV_"+b+".*",
		)
	}
	for _, b := range NodeKeyBuckets {
		// The registry creates the heartbeat buckets if the nodes have not yet.
		p = append(p, "$JS.API.STREAM.CREATE.KV_"+b, "$JS.API.STREAM.UPDATE.KV_"+b)
	}
	// The controller writes each node's effective ImageGCPolicy (and makes the bucket if bus init did not);
	// its copies arbiter keeps the keepCopies grants.
	for _, b := range append(append([]string{}, NodeReadBuckets...), events.GCCopiesBucket) {
		p = append(p, "$KV."+b+".>",
			"$JS.API.STREAM.CREATE.KV_"+b, "$JS.API.STREAM.UPDATE.KV_"+b,
			"$JS.API.DIRECT.GET.KV_"+b+".>",
			"$JS.API.CONSUMER.CREATE.KV_"+b+".>",
			"$JS.API.CONSUMER.MSG.NEXT.KV_"+b+".*",
			"$JS.API.CONSUMER.DELETE.KV_"+b+".*",
		)
	}
	return Permissions{
		Publish:        p,
		Subscribe:      []string{events.Prefix + ".fleet.>", inbox(pub)},
		AllowResponses: true,
	}
}

// InventoryPermissions are the fleet inventory worker's: it consumes every node's image events through
// its partition durables on events.InventoryStream (or, unpartitioned, its shared durable on
// events.EventsStream), keeps the inventory bucket, and answers inventory queries (partitioned: keeps its
// partition leases in events.InventoryOwnersBucket and gathers the other replicas' parts).
func InventoryPermissions(pub string) Permissions {
	b, o := events.InventoryBucket, events.InventoryOwnersBucket
	return Permissions{
		Publish: []string{
			"$JS.API.INFO",
			"$JS.API.STREAM.INFO.*",
			"$JS.API.CONSUMER.CREATE." + events.EventsStream + "." + events.InventoryDurable,
			"$JS.API.CONSUMER.CREATE." + events.EventsStream + "." + events.InventoryDurable + ".>",
			"$JS.API.CONSUMER.INFO." + events.EventsStream + "." + events.InventoryDurable,
			"$JS.API.CONSUMER.MSG.NEXT." + events.EventsStream + "." + events.InventoryDurable,
			"$JS.ACK." + events.EventsStream + "." + events.InventoryDurable + ".>",
			// The partitioned copy of the image events and its partition durables (fleet-inventory-p<pp>):
			// the inventory's alone, created by bus init or by the inventory itself.
			"$JS.API.STREAM.CREATE." + events.InventoryStream,
			"$JS.API.STREAM.UPDATE." + events.InventoryStream,
			"$JS.API.CONSUMER.CREATE." + events.InventoryStream + ".>",
			"$JS.API.CONSUMER.INFO." + events.InventoryStream + ".*",
			"$JS.API.CONSUMER.MSG.NEXT." + events.InventoryStream + ".*",
			"$JS.ACK." + events.InventoryStream + ".>",
			"$JS.API.STREAM.CREATE.KV_" + b,
			"$JS.API.STREAM.UPDATE.KV_" + b,
			"$KV." + b + ".>",
			"$JS.API.DIRECT.GET.KV_" + b + ".>",
			"$JS.API.CONSUMER.CREATE.KV_" + b + ".>",
			"$JS.API.CONSUMER.MSG.NEXT.KV_" + b + ".*",
			// A range or watch ends by deleting its ordered consumer; refused, the client waited out a 5 s
			// API timeout at the end of every range (the re-key pass, a partition taken over).
			"$JS.API.CONSUMER.DELETE.KV_" + b + ".*",
			// The partitioned replicas' partition leases and member keys, and their parts of an answer.
			"$JS.API.STREAM.CREATE.KV_" + o,
			"$JS.API.STREAM.UPDATE.KV_" + o,
			"$KV." + o + ".>",
			"$JS.API.DIRECT.GET.KV_" + o + ".>",
			"$JS.API.CONSUMER.CREATE.KV_" + o + ".>",
			"$JS.API.CONSUMER.MSG.NEXT.KV_" + o + ".*",
			"$JS.API.CONSUMER.DELETE.KV_" + o + ".*",
			events.InventoryPartsSubject,
			events.DeadLetterPrefix + ".>",
		},
		Subscribe:      []string{events.InventoryQuerySubject, events.InventoryPartsSubject, inbox(pub)},
		AllowResponses: true,
	}
}

// SitePermissions are site's server's, on the hub, among sites: what its leaf connection may send to the
// hub (publish) and receive from it (subscribe). Everything in the account but the other sites' domains: a
// site's server is trusted with the hub's domain and its own, since it is the one that enforces its own
// nodes' permissions (each node's client connects to it), but not with another site's JetStream API nor the
// messages addressed to it (events.DomainSubject). The identity may authenticate a leaf connection only
// (Identity.LeafOnly), never a client.
//
// The hub sends these permissions to the site's server when it connects, which then keeps refused messages
// and subscriptions off the link itself: a refusal the hub had to make would close the whole link (nats-
// server closes a leaf connection on a permissions violation and the site redials after 30 s).
func SitePermissions(site string, sites []string) Permissions {
	var deny []string
	for _, other := range sites {
		if other != site {
			deny = append(deny, "$JS."+other+".API.>", events.DomainRoot+"."+other+".>")
		}
	}
	return Permissions{Publish: []string{">"}, Subscribe: []string{">"}, Deny: deny}
}

// AdminPermissions are everything: the operator's CLI (streams, dead-letter replay) and the process that
// creates the streams and buckets.
func AdminPermissions(string) Permissions {
	return Permissions{Publish: []string{">"}, Subscribe: []string{">"}}
}
