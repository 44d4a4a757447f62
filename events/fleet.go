package events

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Fleet subjects, buckets and streams.
//
//	imagefleet.fleet.inventory.query             request/reply, queue group fleet-inventory
//	imagefleet.fleet.inventory.parts             request, every partitioned replica replies (InventoryPart)
//	imagefleet.fleet.rollout.<id>.started        a rollout's plan (RolloutStarted)
//	imagefleet.fleet.rollout.<id>.claim.<node>   the orchestrator is about to act on node (RolloutClaim)
//	imagefleet.fleet.rollout.<id>.batch          a batch started (RolloutBatch)
//	imagefleet.fleet.rollout.<id>.node.<node>    one node's outcome (RolloutNodeResult)
//	imagefleet.fleet.rollout.<id>.finished       the result (RolloutResult)
const (
	// NodesBucket holds each node's last heartbeat with a TTL: a node whose key expired stopped heartbeating.
	NodesBucket = "imagefleet-nodes"
	// NodesSeenBucket holds each node's last heartbeat without a TTL, so a node that stops is shown as lost
	// instead of vanishing.
	NodesSeenBucket = "imagefleet-nodes-seen"
	// InventoryBucket holds the fleet inventory: one key per image and node, InventoryKey (image first, so
	// the nodes holding an image are one key-filtered read); a node-first key of the older layout,
	// InventoryNodeFirstKey, is re-keyed in place by the replicas (compat_nodefirst_keys.go).
	InventoryBucket = "imagefleet-inventory"
	// RolloutStream stores every rollout's event stream (imagefleet.fleet.rollout.>).
	RolloutStream = "IMAGEFLEET_ROLLOUTS"
	// RolloutSubjects is the subject filter of RolloutStream.
	RolloutSubjects = Prefix + ".fleet.rollout.>"
	// InventoryQuerySubject is the inventory's query subject; every replica answers in one queue group.
	InventoryQuerySubject = Prefix + ".fleet.inventory.query"
	// InventoryPartsSubject asks every partitioned replica (no queue group) for its part of a query's
	// answer: the partitions it owns, answered from them alone (InventoryPart). The replica that took an
	// InventoryQuerySubject request gathers the parts until all InventoryPartitions are covered and merges
	// them, so clients ask as before.
	InventoryPartsSubject = Prefix + ".fleet.inventory.parts"
	// InventoryOwnersBucket holds which partitioned replica owns which inventory partition (a lease key
	// per partition, InventoryLeaseKey) and which replicas are alive (InventoryMemberKey), with a TTL: a
	// key not renewed expires, so a stopped replica's partitions are taken over.
	InventoryOwnersBucket = "imagefleet-inventory-owners"
	// ImageEventsFilter matches every image event of every node (the inventory's input).
	ImageEventsFilter = Prefix + ".evt.*." + EntityImage + ".>"
	// PullEventsFilter matches every pull event of every node (a pre-pull's results).
	PullEventsFilter = Prefix + ".evt.*." + EntityPull + ".>"
)

// InventoryImageToken makes an image ID one KV key token: "sha256:<hex>" becomes "sha256_<hex>"; anything
// with other characters becomes "h_" and the SHA-256 of it.
func InventoryImageToken(id string) string {
	t := strings.ReplaceAll(id, ":", "_")
	for _, r := range t {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '=') {
			sum := sha256.Sum256([]byte(id))
			return "h_" + hex.EncodeToString(sum[:])
		}
	}
	return t
}

// InventoryKey is the key of image id on node in InventoryBucket: <image token>.<node token>.
func InventoryKey(id, node string) string { return InventoryImageToken(id) + "." + NodeToken(node) }

// InventoryImageKeys is the key filter of every node holding image id in InventoryBucket. (A node-first key,
// InventoryNodeFirstKey, can match it too, for a node named like an image token: a reader checks the value.)
func InventoryImageKeys(id string) string { return InventoryImageToken(id) + ".*" }

// Rollout event kinds (the subject token after the rollout id).
const (
	RolloutStartedKind  = "started"
	RolloutClaimKind    = "claim"
	RolloutBatchKind    = "batch"
	RolloutNodeKind     = "node"
	RolloutFinishedKind = "finished"
	// RolloutClaimsKind is a claim on a range of the plan's nodes (RolloutClaims, RolloutClaimsSubject).
	RolloutClaimsKind = "claims"
	// RolloutNodesKind is several nodes' outcomes in one record (RolloutNodes, RolloutNodesSubject).
	RolloutNodesKind = "nodes"
)

// Rollout kinds.
const (
	RolloutGC   = "gc"
	RolloutPull = "pull"
)

// RolloutSubject is imagefleet.fleet.rollout.<id>.<kind>, or .<kind>.<node token> when node is set.
func RolloutSubject(id, kind, node string) string {
	s := Prefix + ".fleet.rollout." + id + "." + kind
	if node != "" {
		s += "." + NodeToken(node)
	}
	return s
}

// RolloutClaimsSubject is imagefleet.fleet.rollout.<id>.claims.<first>: the claim on the range of the plan's
// nodes that starts at index first (RolloutClaims). Ranges are cut the same way by every run of a rollout
// (RolloutStarted.ClaimSize), so the first claim stored on the subject decides who acts on all of them.
func RolloutClaimsSubject(id string, first int) string {
	return Prefix + ".fleet.rollout." + id + "." + RolloutClaimsKind + "." + strconv.Itoa(first)
}

// RolloutNodesSubject is imagefleet.fleet.rollout.<id>.nodes.<owner>.<seq>: the seq-th group of outcomes
// recorded by run owner (RolloutNodes).
func RolloutNodesSubject(id, owner string, seq int) string {
	return Prefix + ".fleet.rollout." + id + "." + RolloutNodesKind + "." + owner + "." + strconv.Itoa(seq)
}

// RolloutFilter matches every event of rollout id.
func RolloutFilter(id string) string { return Prefix + ".fleet.rollout." + id + ".>" }

// ValidateRolloutID checks a rollout id: one subject token of lower-case letters, digits and '-', at most 64.
func ValidateRolloutID(id string) error {
	if id == "" {
		return fmt.Errorf("rollout id is empty")
	}
	if len(id) > 64 {
		return fmt.Errorf("rollout id %q is longer than 64 characters", id)
	}
	for _, r := range id {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' {
			return fmt.Errorf("rollout id %q may hold only lower-case letters, digits and '-'", id)
		}
	}
	return nil
}

// ImageFsUsage is a node's image filesystem as its heartbeat reports it.
type ImageFsUsage struct {
	Mountpoint string `json:"mountpoint,omitempty"`
	// UsedBytes is what the runtime's ImageFsInfo reports.
	UsedBytes int64 `json:"usedBytes"`
	// CapacityBytes and AvailableBytes come from statfs of the mountpoint (0 when it cannot be read).
	CapacityBytes  int64 `json:"capacityBytes"`
	AvailableBytes int64 `json:"availableBytes"`
}

// NodeInfo is a node's heartbeat: what it is and how its image filesystem is doing.
type NodeInfo struct {
	Node           string            `json:"node"`
	Labels         map[string]string `json:"labels,omitempty"`
	RuntimeName    string            `json:"runtimeName,omitempty"`
	RuntimeVersion string            `json:"runtimeVersion,omitempty"`
	ImageFs        ImageFsUsage      `json:"imageFs"`
	AgentVersion   string            `json:"agentVersion,omitempty"`
	Workers        []string          `json:"workers,omitempty"`
	// JSDomain is the JetStream domain holding the node's pull work queue when it is not the fleet's: the
	// node's agent is connected to a leaf nats-server with a domain of its own (docs/scale.md). A pull
	// request for the node is published to events.DomainSubject(JSDomain, subject) there. Empty: the
	// fleet's domain.
	JSDomain string `json:"jsDomain,omitempty"`
	// Started is when the agent started; Heartbeat when this heartbeat was sent; Period the heartbeat period.
	Started   time.Time `json:"started"`
	Heartbeat time.Time `json:"heartbeat"`
	Period    Duration  `json:"period"`
	// Error is the last problem reading the runtime (the heartbeat is still sent).
	Error string `json:"error,omitempty"`
}

// NodeAlive is the thin heartbeat an agent writes into NodesBucket every period (its full NodeInfo goes into
// NodesSeenBucket when it changed, and every so often). Its fields are NodeInfo's, so a reader decodes either
// shape as a NodeInfo: the thin one, or the full NodeInfo (Started is set) that an agent of the full-heartbeat
// layout writes into both buckets (docs/upgrading.md, "Compatibility paths").
type NodeAlive struct {
	Node      string    `json:"node"`
	Heartbeat time.Time `json:"heartbeat"`
	Period    Duration  `json:"period"`
}

// Node states in the registry.
const (
	NodeReady = "Ready"
	NodeLost  = "Lost"
)

// NodeStatus is a node as `imagefleet fleet nodes` shows it.
type NodeStatus struct {
	NodeInfo
	State string `json:"state"`
	// Age is how long ago the last heartbeat was sent.
	Age Duration `json:"age"`
}

// InventoryLeaseKey is partition p's lease key in InventoryOwnersBucket: p.<pp>; its value is the owner's
// replica name.
func InventoryLeaseKey(p int) string { return fmt.Sprintf("p.%02d", p) }

// InventoryMemberKey is replica's key in InventoryOwnersBucket: r.<token> (a token made as
// InventoryImageToken makes one); its value is the replica name.
func InventoryMemberKey(replica string) string { return "r." + InventoryImageToken(replica) }

// InventoryPart is one partitioned replica's part of an inventory answer (InventoryPartsSubject): the
// answer from the placements of the partitions it owns. For where and nodes the part is paged as the query
// asks (each part is sorted, so the first Limit of the merged parts are the answer's); for images it holds
// the images of its partitions in ID order, a chunk at a time (InventoryPartQuery.After), since an image's
// totals add up over partitions and their order is known only after the merge.
type InventoryPart struct {
	Replica    string         `json:"replica"`
	Partitions []int          `json:"partitions"`
	Reply      InventoryReply `json:"reply"`
}

// InventoryPartQuery is the body of InventoryPartsSubject: what the gathering replica asks every
// partitioned replica for, answered from the partitions it owns (InventoryPart).
type InventoryPartQuery struct {
	// Query is the client's query. where and nodes parts are paged as it asks (Limit, Continue).
	Query InventoryQuery `json:"query"`
	// Resolve asks for the image IDs the part knows Query.Image by (tag, digest, ID prefix), in
	// Reply.Images with only ID set: a tag may be known on some nodes of an image and not on others, so
	// the IDs of a where are resolved over every part first.
	Resolve bool `json:"resolve,omitempty"`
	// IDs are a where's image IDs, resolved over every part: the part yields their placements.
	IDs []string `json:"ids,omitempty"`
	// After and Chunk page an images part by image ID: at most Chunk images (0: all) with IDs after After,
	// Reply.Continue the last one's ID when more follow (an images part is merged before it is paged, so
	// it travels whole, in chunks that each stay far under the server's max payload).
	After string `json:"after,omitempty"`
	Chunk int    `json:"chunk,omitempty"`
}

// InventoryQuery is the body of imagefleet.fleet.inventory.query.
type InventoryQuery struct {
	// What: "images" (every image with totals), "where" (the nodes holding Image), "nodes" (totals per node).
	What string `json:"what"`
	// Image is an image ID (or a unique prefix of at least 6 hex digits), a tag or a digest reference.
	Image string `json:"image,omitempty"`
	// Limit caps the answer (0: no cap).
	Limit int `json:"limit,omitempty"`
	// Continue is the previous answer's Continue: this answer starts after it (an additive field: a replica
	// that does not page refuses a query that sets it; docs/upgrading.md, "Compatibility paths").
	Continue string `json:"continue,omitempty"`
}

// Inventory query kinds.
const (
	InventoryImages = "images"
	InventoryWhere  = "where"
	InventoryNodes  = "nodes"
)

// Validate checks the query.
func (q InventoryQuery) Validate() error {
	switch q.What {
	case InventoryImages, InventoryNodes:
	case InventoryWhere:
		if strings.TrimSpace(q.Image) == "" {
			return fmt.Errorf("a where query needs an image")
		}
	default:
		return fmt.Errorf("what %q must be images, where or nodes", q.What)
	}
	if q.Limit < 0 {
		return fmt.Errorf("limit %d must not be negative", q.Limit)
	}
	return nil
}

// Placement is one image on one node.
type Placement struct {
	Node        string    `json:"node"`
	ID          string    `json:"id"`
	RepoTags    []string  `json:"repoTags,omitempty"`
	RepoDigests []string  `json:"repoDigests,omitempty"`
	Size        int64     `json:"size"`
	Pinned      bool      `json:"pinned,omitempty"`
	InUse       bool      `json:"inUse,omitempty"`
	LastUsed    time.Time `json:"lastUsed"`
	// Seq is the stream sequence of the event that wrote this placement.
	Seq uint64 `json:"seq"`
	// Gone marks a removed or vanished image (kept as a tombstone so a late, older event cannot bring it back).
	Gone bool `json:"gone,omitempty"`
}

// InventoryImage is one image across the fleet.
type InventoryImage struct {
	ID          string    `json:"id"`
	RepoTags    []string  `json:"repoTags,omitempty"`
	RepoDigests []string  `json:"repoDigests,omitempty"`
	Size        int64     `json:"size"`
	Nodes       int       `json:"nodes"`
	TotalBytes  int64     `json:"totalBytes"`
	LastUsed    time.Time `json:"lastUsed"`
}

// InventoryNode is one node's totals.
type InventoryNode struct {
	Node       string `json:"node"`
	Images     int    `json:"images"`
	TotalBytes int64  `json:"totalBytes"`
}

// InventoryReply answers an inventory query; only the part the query asked for is set.
type InventoryReply struct {
	Images     []InventoryImage `json:"images,omitempty"`
	Placements []Placement      `json:"placements,omitempty"`
	Nodes      []InventoryNode  `json:"nodes,omitempty"`
	// Total counts the entries before Limit; TotalBytes sums them.
	Total      int   `json:"total"`
	TotalBytes int64 `json:"totalBytes"`
	// Continue is set when entries follow this answer: the query's Continue for the next page.
	Continue string `json:"continue,omitempty"`
	// Replica names the replica that answered.
	Replica string `json:"replica,omitempty"`
}

// RolloutStarted is the plan of a rollout: the nodes chosen, in the order they are acted on.
type RolloutStarted struct {
	ID           string     `json:"id"`
	Kind         string     `json:"kind"`
	Selector     string     `json:"selector,omitempty"`
	InitialBatch int        `json:"initialBatch"`
	NodeTimeout  Duration   `json:"nodeTimeout"`
	DryRun       bool       `json:"dryRun"`
	Image        string     `json:"image,omitempty"`
	GC           *GCRequest `json:"gc,omitempty"`
	Nodes        []string   `json:"nodes"`
	// Skipped are nodes that matched the selector but were not planned (lost).
	Skipped []RolloutNodeError `json:"skipped,omitempty"`
	Time    time.Time          `json:"time"`
	// MaxFailures is the failure budget, a count ("10") or a percentage of Nodes ("5%"); empty: none may
	// fail (added field: a plan without it, or a reader without it, has the budget of before, 0).
	MaxFailures string `json:"maxFailures,omitempty"`
	// ClaimSize is how the plan's nodes are claimed and their outcomes recorded: each batch is cut into
	// ranges of at most ClaimSize nodes from its first, each claimed by one RolloutClaims record, and the
	// outcomes are written in groups (RolloutNodes). 0 (a plan of an earlier release): one RolloutClaim
	// and one outcome record per node.
	ClaimSize int `json:"claimSize,omitempty"`
}

// RolloutClaim records that run Owner is about to act on Node: a node with a claim is never acted on again
// in this rollout.
type RolloutClaim struct {
	Node  string    `json:"node"`
	Owner string    `json:"owner"`
	Batch int       `json:"batch"`
	Time  time.Time `json:"time"`
}

// RolloutClaims records that run Owner is about to act on Nodes, the plan's nodes First to
// First+len(Nodes)-1 of batch Batch: none of them is acted on again in this rollout. It is stored on
// RolloutClaimsSubject(id, First) only when that subject is empty, so of two runs exactly one claims a range.
type RolloutClaims struct {
	First int       `json:"first"`
	Nodes []string  `json:"nodes"`
	Owner string    `json:"owner"`
	Batch int       `json:"batch"`
	Time  time.Time `json:"time"`
}

// Claims is the range's claim on each of its nodes.
func (c RolloutClaims) Claims() []RolloutClaim {
	out := make([]RolloutClaim, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = RolloutClaim{Node: n, Owner: c.Owner, Batch: c.Batch, Time: c.Time}
	}
	return out
}

// RolloutNodes is a group of node outcomes recorded by run Owner in one record: the outcomes that ended
// while the previous group was being written.
type RolloutNodes struct {
	Owner string              `json:"owner"`
	Nodes []RolloutNodeResult `json:"nodes"`
}

// RolloutBatch records that a batch started.
type RolloutBatch struct {
	Index int       `json:"index"`
	Size  int       `json:"size"`
	Nodes []string  `json:"nodes"`
	Time  time.Time `json:"time"`
}

// PullOutcome is what a node's puller reported for a fleet pull.
type PullOutcome struct {
	ImageRef string `json:"imageRef,omitempty"`
	Error    string `json:"error,omitempty"`
	Message  string `json:"message,omitempty"`
}

// RolloutNodeResult is one node's outcome.
type RolloutNodeResult struct {
	Node     string       `json:"node"`
	Batch    int          `json:"batch"`
	OK       bool         `json:"ok"`
	Error    string       `json:"error,omitempty"`
	GC       *GCResult    `json:"gc,omitempty"`
	Pull     *PullOutcome `json:"pull,omitempty"`
	Duration Duration     `json:"duration"`
	// Resumed marks an outcome carried over from an earlier run of the same rollout (not acted on again).
	Resumed bool `json:"resumed,omitempty"`
	// GCCounts sums GC (added field). The outcome records of a real (not dry) GC rollout carry it instead of
	// the lists of removed, failed and skipped images, which they leave out of GC (docs/scale.md: a few
	// hundred bytes per node instead of kilobytes); dry-run records and records written before this field
	// keep the lists. Read either with Counts.
	GCCounts *GCCounts `json:"gcCounts,omitempty"`
}

// GCCounts sums a node's GC result.
type GCCounts struct {
	// Removed counts the images removed (in a dry run: that would be removed) without error.
	Removed int `json:"removed"`
	// Failed counts the removals that failed.
	Failed int `json:"failed"`
	// Skipped counts the images GC left alone (pinned, in use, too young ...).
	Skipped int `json:"skipped"`
	// Bytes sums the sizes of the images removed (would be removed) without error.
	Bytes int64 `json:"bytes"`
}

// Counts returns the sums of the node's GC result: GCCounts when the record carries it, else counted from
// GC's lists (dry runs, older records); zero for a node without a GC result.
func (r RolloutNodeResult) Counts() GCCounts {
	if r.GCCounts != nil {
		return *r.GCCounts
	}
	if r.GC == nil {
		return GCCounts{}
	}
	c := GCCounts{Skipped: len(r.GC.Skipped)}
	for _, rm := range r.GC.Removed {
		if rm.Error != "" {
			c.Failed++
			continue
		}
		c.Removed++
		c.Bytes += rm.Size
	}
	return c
}

// Compact returns the outcome as a real GC rollout records it: GC without its lists of images, GCCounts
// with their sums. Dry runs and outcomes without a GC result are returned as they are.
func (r RolloutNodeResult) Compact() RolloutNodeResult {
	if r.GC == nil || r.GC.DryRun {
		return r
	}
	c := r.Counts()
	gc := *r.GC
	gc.Removed, gc.Skipped, gc.Failed = nil, nil, nil
	r.GC, r.GCCounts = &gc, &c
	return r
}

// RolloutNodeError names a node and why it failed or was skipped.
type RolloutNodeError struct {
	Node  string `json:"node"`
	Error string `json:"error"`
}

// RolloutResult is the result of a rollout (`fleet gc -o json`, `fleet pull -o json`).
type RolloutResult struct {
	ID     string `json:"id"`
	Kind   string `json:"kind"`
	DryRun bool   `json:"dryRun"`
	// Batches are the sizes of the batches started, in order.
	Batches   []int `json:"batches"`
	Succeeded int   `json:"succeeded"`
	// Failed lists the failed nodes: all of them up to a bound (the orchestrator's MaxFailures, 1,000 by
	// default), in plan order; FailedCount counts them all.
	Failed []RolloutNodeError `json:"failed"`
	// FailedCount counts the failed nodes (added field: results written before it leave it 0; read it with
	// FailedTotal).
	FailedCount int `json:"failedCount"`
	// NotStarted counts planned nodes no batch reached (a batch failed before).
	NotStarted int                `json:"notStarted"`
	Skipped    []RolloutNodeError `json:"skipped,omitempty"`
	// Nodes are the outcomes in plan order (the finished record of the rollout stream leaves them out:
	// each is a record of its own). `fleet gc|pull -o json` writes them as they arrive instead, in the
	// order the nodes ended.
	Nodes []RolloutNodeResult `json:"nodes"`
	// FreedBytes sums the bytes GC freed, or in a dry run would free, on the nodes that answered.
	FreedBytes int64     `json:"freedBytes"`
	Error      string    `json:"error,omitempty"`
	Started    time.Time `json:"started"`
	Duration   Duration  `json:"duration"`
	// MaxFailures is the failure budget as planned ("0", "10", "5%") and FailureBudget the failed nodes it
	// allows; StopReason says why no further batch started: RolloutCompleted, RolloutMaxFailuresExceeded,
	// or the reason of the orchestrator that ended it at a batch's start (the controller's WindowEnded)
	// (empty when the rollout was interrupted). Added fields: results written before them leave them empty.
	MaxFailures   string `json:"maxFailures,omitempty"`
	FailureBudget int    `json:"failureBudget"`
	StopReason    string `json:"stopReason,omitempty"`
}

// A rollout's StopReason.
const (
	// RolloutCompleted: every planned batch ran (nodes may have failed within the failure budget).
	RolloutCompleted = "Completed"
	// RolloutMaxFailuresExceeded: the failed nodes passed the failure budget (with the default budget, 0:
	// a batch had a failure) and no further batch started.
	RolloutMaxFailuresExceeded = "MaxFailuresExceeded"
)

// FailedTotal is the number of failed nodes: FailedCount, or for a result written before that field,
// len(Failed).
func (r RolloutResult) FailedTotal() int { return max(r.FailedCount, len(r.Failed)) }
