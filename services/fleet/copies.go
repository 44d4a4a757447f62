package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// CopiesArbiter answers the GC executors' keepCopies requests (events.CopiesSubject, queue group
// events.CopiesQueue): which of the images a node is about to remove may go without leaving fewer than N
// copies of one in the fleet, or in the node's zone (docs/gc-policies.md).
//
// The copies of an image are the nodes the inventory shows holding it (events.InventoryBucket, tombstones
// left out), less the nodes a removal was granted to that the inventory does not yet show gone. The grants
// of one image live in its key of events.GCCopiesBucket and every grant is a compare-and-set of that key, so
// two requests for one image, on one replica or two, never both count the same copies: the second sees the
// first's grant, or its write fails and it reads again.
//
// A grant ends on evidence, not on time alone, because the inventory can lag a removal by any time (its
// worker down, its stream behind): the inventory showing the node's placement gone ends it; so does the
// node's release (events.CopiesRequest.Release: its removal failed); past GrantTTL, so does the inventory
// showing the node's placement written again since the grant (its events.Placement.Seq changed: the node
// reported the image after the grant, so it still holds it). Past GrantTTL with the placement as it was at
// the grant, the grant holds: the inventory may simply not have caught up with the removal (the safe side).
// A grant written by an older arbiter, without the placement's Seq, ends at GrantTTL as it always did.
//
// A node asks on its own subject (events.CopiesSubject; the NATS permissions let it publish there only),
// and the arbiter refuses a request whose Node is not the subject's, so a node cannot take, or give back,
// another node's grants.
type CopiesArbiter struct {
	b   *bus.Bus
	cfg CopiesConfig

	mu          sync.Mutex
	inv, ledger *bus.KV
}

// CopiesConfig configures a CopiesArbiter.
type CopiesConfig struct {
	// GrantTTL is how long a granted removal counts as done, whatever the inventory shows of the node since
	// (default 10m); after it, the inventory showing the node's image written again since the grant ends
	// the grant. It never ends a grant on its own.
	GrantTTL time.Duration
	// Labels returns every registry node's labels (default: the node registry's).
	Labels func(ctx context.Context) (map[string]map[string]string, error)
	// Now (default time.Now).
	Now func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// copiesLedger is an image's value in events.GCCopiesBucket: the nodes a removal was granted to, until when
// the time alone keeps the grant, and the Seq of each node's placement at the grant.
type copiesLedger struct {
	Grants map[string]time.Time `json:"grants"`
	// Seqs is an added field: a grant without one (an older arbiter's) ends at its time.
	Seqs map[string]uint64 `json:"seqs,omitempty"`
}

// holds reports whether node's grant still holds its copy uncounted, with holders the inventory's view
// (node -> its placement's Seq).
func (l copiesLedger) holds(node string, now time.Time, holders map[string]uint64) bool {
	seq, held := holders[node]
	if !held {
		return false // the inventory shows the removal
	}
	if now.Before(l.Grants[node]) {
		return true
	}
	granted, recorded := l.Seqs[node]
	return recorded && granted == seq
}

// maxCopiesImages bounds one request (a removal batch is 4 x the removal parallelism).
const maxCopiesImages = 1024

// NewCopiesArbiter builds an arbiter over b.
func NewCopiesArbiter(b *bus.Bus, cfg CopiesConfig) *CopiesArbiter {
	if cfg.GrantTTL <= 0 {
		cfg.GrantTTL = 10 * time.Minute
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	a := &CopiesArbiter{b: b, cfg: cfg}
	if a.cfg.Labels == nil {
		var reg *Registry
		a.cfg.Labels = func(ctx context.Context) (map[string]map[string]string, error) {
			if reg == nil {
				r, err := OpenRegistry(ctx, b, RegistryOptions{})
				if err != nil {
					return nil, err
				}
				reg = r
			}
			nodes, err := reg.Nodes(ctx)
			if err != nil {
				return nil, err
			}
			out := make(map[string]map[string]string, len(nodes))
			for _, n := range nodes {
				out[n.Node] = n.Labels
			}
			return out, nil
		}
	}
	return a
}

// Run answers requests until ctx ends.
func (a *CopiesArbiter) Run(ctx context.Context) error {
	err := a.b.ServeConcurrent(ctx, events.Prefix+".fleet.copies.*", events.CopiesQueue, 16, a.Handle)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// Handle answers one events.CopiesRequest with an events.CopiesReply.
func (a *CopiesArbiter) Handle(ctx context.Context, data []byte) (any, error) {
	var req events.CopiesRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	if err := events.ValidateNodeName(req.Node); err != nil {
		return nil, fmt.Errorf("%w: %w", events.ErrMalformed, err)
	}
	// The subject is what the server's permissions checked; the body's name is the sender's word.
	subject := bus.RequestSubject(ctx)
	if token := subject[strings.LastIndexByte(subject, '.')+1:]; token == "" || token != events.NodeToken(req.Node) {
		return nil, fmt.Errorf("%w: copies request for node %q on subject %q: a node asks on its own subject only", events.ErrMalformed, req.Node, subject)
	}
	if len(req.Images) > maxCopiesImages {
		return nil, fmt.Errorf("%w: copies request: images %d at most %d", events.ErrMalformed, len(req.Images), maxCopiesImages)
	}
	if req.Release {
		if req.DryRun {
			return nil, fmt.Errorf("%w: copies request: a release is not a dry run", events.ErrMalformed)
		}
		_, ledger, err := a.buckets(ctx)
		if err != nil {
			return nil, err
		}
		for _, id := range req.Images {
			if err := a.release(ctx, ledger, req.Node, id); err != nil {
				return nil, fmt.Errorf("release copies of %s: %w", id, err)
			}
		}
		return nil, nil
	}
	if req.Count < 1 {
		return nil, fmt.Errorf("%w: copies request: count %d must be at least 1", events.ErrMalformed, req.Count)
	}
	inv, ledger, err := a.buckets(ctx)
	if err != nil {
		return nil, err
	}
	var labels map[string]map[string]string
	if req.TopologyKey != "" {
		if labels, err = a.cfg.Labels(ctx); err != nil {
			return nil, err
		}
	}
	inZone := func(node string) bool { return req.TopologyKey == "" || labels[node][req.TopologyKey] == req.Zone }
	rep := events.CopiesReply{Allowed: []string{}, Copies: map[string]int{}}
	for _, id := range req.Images {
		ok, copies, err := a.decide(ctx, inv, ledger, req, id, inZone)
		if err != nil {
			return nil, fmt.Errorf("copies of %s: %w", id, err)
		}
		rep.Copies[id] = copies
		if ok {
			rep.Allowed = append(rep.Allowed, id)
		}
	}
	return rep, nil
}

// decide grants (or, in a dry run, tells) node's removal of id when the other copies in its zone, less the
// granted removals, are at least Count. It returns the copies counted, node's own included.
func (a *CopiesArbiter) decide(ctx context.Context, inv, ledger *bus.KV, req events.CopiesRequest, id string, inZone func(string) bool) (bool, int, error) {
	key := events.InventoryImageToken(id)
	for range 20 {
		raw, rev, err := ledger.Get(ctx, key)
		if err != nil && !errors.Is(err, bus.ErrKeyNotFound) {
			return false, 0, err
		}
		var l copiesLedger
		if len(raw) > 0 {
			if err := json.Unmarshal(raw, &l); err != nil {
				a.cfg.Logger.Warn("copies ledger entry unreadable, starting it again", "image_id", id, "err", err)
			}
		}
		holders, err := a.holders(ctx, inv, id)
		if err != nil {
			return false, 0, err
		}
		now := a.cfg.Now()
		// Grants still counted (copiesLedger.holds); the others are dropped from the ledger at this write.
		live := copiesLedger{Grants: map[string]time.Time{}, Seqs: map[string]uint64{}}
		for n, until := range l.Grants {
			if l.holds(n, now, holders) {
				live.Grants[n] = until
				if seq, ok := l.Seqs[n]; ok {
					live.Seqs[n] = seq
				}
			}
		}
		_, held := holders[req.Node]
		others, self := 0, held && inZone(req.Node)
		for n := range holders {
			if n != req.Node && inZone(n) {
				if _, granted := live.Grants[n]; !granted {
					others++
				}
			}
		}
		copies := others
		if self {
			copies++
		}
		if others < req.Count || req.DryRun {
			return others >= req.Count, copies, nil
		}
		live.Grants[req.Node] = now.Add(a.cfg.GrantTTL)
		if held {
			live.Seqs[req.Node] = holders[req.Node]
		}
		val, err := json.Marshal(live)
		if err != nil {
			return false, 0, err
		}
		if rev == 0 {
			_, err = ledger.Create(ctx, key, val)
		} else {
			_, err = ledger.Update(ctx, key, val, rev)
		}
		if errors.Is(err, bus.ErrConflict) {
			continue // another grant of this image came first: count again
		}
		if err != nil {
			return false, 0, err
		}
		return true, copies, nil
	}
	return false, 0, errors.New("too many concurrent grants of the image; asked again at the next pass")
}

// release removes node's grant of id, if any, with a compare-and-set of the image's key.
func (a *CopiesArbiter) release(ctx context.Context, ledger *bus.KV, node, id string) error {
	key := events.InventoryImageToken(id)
	for range 20 {
		raw, rev, err := ledger.Get(ctx, key)
		if errors.Is(err, bus.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		var l copiesLedger
		if err := json.Unmarshal(raw, &l); err != nil {
			return nil // unreadable: the next grant of the image starts it again, without this one
		}
		if _, ok := l.Grants[node]; !ok {
			return nil
		}
		delete(l.Grants, node)
		delete(l.Seqs, node)
		val, err := json.Marshal(l)
		if err != nil {
			return err
		}
		if _, err = ledger.Update(ctx, key, val, rev); errors.Is(err, bus.ErrConflict) {
			continue // another grant or release of this image came first: read again
		}
		return err
	}
	return errors.New("too many concurrent grants of the image; the grant holds")
}

// holders are the nodes the inventory shows holding id (tombstones left out), each with its placement's Seq.
func (a *CopiesArbiter) holders(ctx context.Context, inv *bus.KV, id string) (map[string]uint64, error) {
	entries, err := inv.List(ctx, events.InventoryImageKeys(id))
	if err != nil {
		return nil, err
	}
	out := make(map[string]uint64, len(entries))
	for _, e := range entries {
		var p events.Placement
		if json.Unmarshal(e.Value, &p) != nil || p.ID != id || p.Gone {
			continue
		}
		out[p.Node] = max(out[p.Node], p.Seq)
	}
	return out, nil
}

// buckets opens the inventory (as it is) and the ledger (made when missing).
func (a *CopiesArbiter) buckets(ctx context.Context) (inv, ledger *bus.KV, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inv == nil {
		kv, err := a.b.KVExisting(ctx, events.InventoryBucket)
		if err != nil {
			return nil, nil, fmt.Errorf("copies: %w", err)
		}
		a.inv = kv
	}
	if a.ledger == nil {
		kv, err := a.b.KV(ctx, CopiesBucketConfig())
		if err != nil {
			return nil, nil, fmt.Errorf("copies: %w", err)
		}
		a.ledger = kv
	}
	return a.inv, a.ledger, nil
}

// CopiesBucketConfig is the keepCopies ledger bucket (bus init makes it).
func CopiesBucketConfig() bus.KVConfig {
	return bus.KVConfig{Bucket: events.GCCopiesBucket, Description: "keepCopies removal grants per image"}
}
