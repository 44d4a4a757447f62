package fleet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Partition ownership of the partitioned inventory. Every replica keeps a member key alive in
// events.InventoryOwnersBucket and holds the lease keys of the partitions it owns; the bucket's TTL
// expires the keys of a replica that stops renewing them, so its partitions are free to take. Each replica
// aims at its share, ceil(16 / live replicas): one below it takes free partitions (create: one wins), one
// above it gives up its highest ones (delete), so a replica that joins gets partitions from the others
// within a few renewals and one that leaves has its partitions taken within the TTL. A round also runs as
// soon as the watch shows a lease given up or a replica joining or leaving (kick), so a handover does
// not wait for the next renewal.
const (
	// ownersTTL is the owners bucket's TTL: how long a lease or member key lives unrenewed.
	ownersTTL = 10 * time.Second
	// ownersRenew is how often a replica renews its keys and rebalances.
	ownersRenew = 2 * time.Second
	// ownersMargin is how long before its lease could expire a replica stops answering for a partition
	// whose renewals fail: the lease's expiry is counted from the server's store time, which is after the
	// renewal was sent, so a replica stops answering for a partition before anyone else can take it. Every
	// bucket operation of a round has ownersOpTimeout, so a round ends well within the margin.
	ownersMargin = 3 * time.Second
	// ownersOpTimeout bounds one request to the owners bucket.
	ownersOpTimeout = time.Second
	// ownersSettle is how long a round asked for by a lease given up waits for the others given up with it.
	ownersSettle = 200 * time.Millisecond
)

// ownersBucket configures events.InventoryOwnersBucket.
func ownersBucket(replicas int) bus.KVConfig {
	return bus.KVConfig{Bucket: events.InventoryOwnersBucket, TTL: ownersTTL, Replicas: replicas,
		Description: "imagefleet inventory: partition leases and live replicas of the partitioned inventory"}
}

// lease is a partition this replica holds: the revision to renew it on and when its last renewal was sent.
type lease struct {
	rev  uint64
	sent time.Time
}

// seenKey is an owners bucket key as the watch last saw it: its value, revision, and when it was written
// (the server's time, but never later than when it was seen).
type seenKey struct {
	value string
	rev   uint64
	at    time.Time
}

// live reports whether the key is within its TTL at now (not expired unrenewed).
func (k seenKey) live(now time.Time) bool { return now.Sub(k.at) < ownersTTL }

// owners keeps this replica's partition leases. Changes are reported to change, from one goroutine, in
// order: released partitions before the lease is deleted, acquired ones after the lease is created.
type owners struct {
	kv      *bus.KV
	replica string
	log     *slog.Logger
	now     func() time.Time
	change  func(acquired, released []int)

	// first is closed after the first round: the partitions this replica starts with are taken.
	first chan struct{}
	// freed and members ask for a round before the next tick: freed when a lease was given up (free to
	// take now), members when a replica came or went (the shares change).
	freed, members chan struct{}

	mu   sync.Mutex
	seen map[string]seenKey // key -> value and when last written (deleted keys leave; expired ones stay, told by seenKey.live)
	held map[int]lease
}

func newOwners(kv *bus.KV, replica string, log *slog.Logger, change func(acquired, released []int)) *owners {
	return &owners{kv: kv, replica: replica, log: log, now: time.Now, change: change,
		seen: map[string]seenKey{}, held: map[int]lease{}, first: make(chan struct{}),
		freed: make(chan struct{}, 1), members: make(chan struct{}, 1)}
}

// watch keeps seen up to date until ctx ends; ready is closed once the bucket's keys are loaded.
func (o *owners) watch(ctx context.Context, ready chan<- struct{}) error {
	var once sync.Once
	loaded := false // the watch's initial values are done
	return o.kv.Watch(ctx, ">", func(e bus.Entry, initialDone bool) {
		if initialDone {
			loaded = true
			once.Do(func() { close(ready) })
			return
		}
		o.mu.Lock()
		defer o.mu.Unlock()
		_, known := o.seen[e.Key]
		member := strings.HasPrefix(e.Key, "r.")
		if e.Deleted {
			delete(o.seen, e.Key)
			switch {
			case known && member:
				kick(o.members) // a replica gone: the shares grow
			case known:
				kick(o.freed) // a lease given up
			}
			return
		}
		if !known && member {
			kick(o.members) // a replica joined: one above its share gives some up
		}
		at := o.now()
		if !loaded && !e.Created.IsZero() && e.Created.Before(at) {
			// A key read at start was written when it says, not now: a lease of a replica killed just before
			// expires from its last renewal. A write seen later is dated when seen, by this replica's own
			// clock, so a clock ahead of the server's does not make every renewal look expired (and every
			// other replica gone: shares, and gather rounds ending before their parts came).
			at = e.Created
		}
		o.seen[e.Key] = seenKey{value: string(e.Value), rev: e.Revision, at: at}
	})
}

// run renews and rebalances every ownersRenew until ctx ends, then releases every lease it holds (so
// another replica takes them at once instead of after the TTL). The first round waits one period after
// the member key is written, so replicas that start together see each other before they take partitions.
func (o *owners) run(ctx context.Context) error {
	ready := make(chan struct{})
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	werr := make(chan error, 1)
	go func() { werr <- o.watch(wctx, ready) }()
	watchEnded := func(err error) error {
		if err == nil {
			err = errors.New("the owners watch ended")
		}
		return fmt.Errorf("partition leases: %w", err)
	}
	select {
	case <-ctx.Done():
		stop()
		<-werr
		return nil
	case err := <-werr:
		return watchEnded(err)
	case <-ready:
	}
	o.member(ctx)
	firstDone := func() {
		select {
		case <-o.first:
		default:
			close(o.first)
		}
	}
	t := time.NewTicker(ownersRenew)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			o.releaseAll()
			stop()
			<-werr
			return nil
		case err := <-werr:
			o.releaseAll()
			return watchEnded(err)
		case <-t.C:
			o.member(ctx)
			o.round(ctx)
			firstDone()
		case <-o.freed:
			// A lease given up is taken at once, not up to a renewal later: by a replica that has just
			// joined too (the replica giving it up saw it join, and it sees that replica's member key).
			// The leases a replica gives up are deleted one after another: the round waits ownersSettle
			// so it takes them together (one read of the bucket for all, not one per lease).
			select {
			case <-ctx.Done():
				continue
			case <-time.After(ownersSettle):
			}
			select {
			case <-o.freed:
			default:
			}
			o.round(ctx)
			firstDone()
		case <-o.members:
			// The shares changed: a replica above its new share gives partitions up at once. Before its
			// first round a replica waits for the tick, so replicas starting together see each other.
			select {
			case <-o.first:
				o.round(ctx)
			default:
			}
		}
	}
}

// errNotOurs: a partition's lease names another replica, or is gone.
var errNotOurs = errors.New("the lease is not this replica's")

// reclaim renews partition p's lease on its current revision when the lease still names this replica. A
// renewal that timed out (a server slow under load) may have been stored all the same: the lease's
// revision moved past the one held, and the next renewal conflicts with this replica's own write. Only this
// replica writes its name, so the lease is still its own; dropped and taken back, the partition went
// unanswered and was read again from the whole bucket. It returns errNotOurs when the lease names another
// replica or is gone (expired), and then only; another error leaves the lease held, on the revision read.
func (o *owners) reclaim(ctx context.Context, p int) (rev uint64, sent time.Time, err error) {
	key := events.InventoryLeaseKey(p)
	gctx, cancel := context.WithTimeout(ctx, ownersOpTimeout)
	v, cur, err := o.kv.Get(gctx, key)
	cancel()
	switch {
	case errors.Is(err, bus.ErrKeyNotFound):
		return 0, time.Time{}, errNotOurs
	case err != nil:
		return 0, time.Time{}, err
	case string(v) != o.replica:
		return 0, time.Time{}, errNotOurs
	}
	o.mu.Lock()
	o.held[p] = lease{rev: cur, sent: o.held[p].sent} // renewed on cur from here, whatever the update says
	o.mu.Unlock()
	sent = o.now()
	uctx, cancel := context.WithTimeout(ctx, ownersOpTimeout)
	defer cancel()
	rev, err = o.kv.Update(uctx, key, []byte(o.replica), cur)
	if errors.Is(err, bus.ErrConflict) {
		return 0, time.Time{}, errNotOurs
	}
	return rev, sent, err
}

// kick asks the run loop for a round now; kicks while one is pending are one.
func kick(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

func (o *owners) member(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, ownersOpTimeout)
	defer cancel()
	if _, err := o.kv.Put(ctx, events.InventoryMemberKey(o.replica), []byte(o.replica)); err != nil && ctx.Err() == nil {
		o.log.Warn("inventory: member key not renewed", "err", err)
	}
}

// round renews the leases held, then takes or gives up partitions toward this replica's share.
func (o *owners) round(ctx context.Context) {
	if lost := o.renew(ctx); len(lost) > 0 {
		o.drop(lost)
		o.change(nil, lost)
	}
	if ctx.Err() != nil {
		return
	}
	share := o.share()
	held := o.heldSorted()
	if len(held) > share {
		extra := held[share:]
		gone := o.drop(extra)
		o.change(nil, extra)
		o.release(ctx, gone)
		return
	}
	if got := o.acquire(ctx, share-len(held)); len(got) > 0 {
		o.change(got, nil)
	}
}

// renew renews the leases this replica holds and returns the partitions it lost: expired unrenewed, or
// taken by another replica.
func (o *owners) renew(ctx context.Context) (lost []int) {
	for _, p := range o.heldSorted() {
		o.mu.Lock()
		l := o.held[p]
		o.mu.Unlock()
		if !o.valid(p) {
			// Not renewed for too long (the bucket unreachable): another replica may have it by now.
			o.log.Warn("inventory: partition lease expired unrenewed", "partition", p)
			lost = append(lost, p)
			continue
		}
		sent := o.now()
		octx, cancel := context.WithTimeout(ctx, ownersOpTimeout)
		rev, err := o.kv.Update(octx, events.InventoryLeaseKey(p), []byte(o.replica), l.rev)
		cancel()
		switch {
		case err == nil:
			o.mu.Lock()
			o.held[p] = lease{rev: rev, sent: sent}
			o.mu.Unlock()
		case errors.Is(err, bus.ErrConflict):
			switch rev, sent, err := o.reclaim(ctx, p); {
			case err == nil:
				o.mu.Lock()
				o.held[p] = lease{rev: rev, sent: sent}
				o.mu.Unlock()
			case errors.Is(err, errNotOurs):
				// Expired and maybe taken: not ours any more.
				o.log.Warn("inventory: partition lease lost", "partition", p)
				lost = append(lost, p)
			default:
				if ctx.Err() == nil {
					o.log.Warn("inventory: partition lease not renewed", "partition", p, "err", err)
				}
			}
		default:
			if ctx.Err() == nil {
				o.log.Warn("inventory: partition lease not renewed", "partition", p, "err", err)
			}
		}
	}
	return lost
}

// acquire takes up to want free partitions (or leases in this replica's own name from before a restart)
// and returns those it took.
func (o *owners) acquire(ctx context.Context, want int) (got []int) {
	for _, c := range o.free() {
		p := c.p
		if len(got) >= want {
			break
		}
		sent := o.now()
		octx, cancel := context.WithTimeout(ctx, ownersOpTimeout)
		var rev uint64
		var err error
		if c.mine {
			// A lease in this replica's name it does not hold: its own, from before a restart.
			rev, err = o.kv.Update(octx, events.InventoryLeaseKey(p), []byte(o.replica), c.rev)
		} else {
			rev, err = o.kv.Create(octx, events.InventoryLeaseKey(p), []byte(o.replica))
		}
		cancel()
		if err != nil {
			if !errors.Is(err, bus.ErrConflict) && ctx.Err() == nil {
				o.log.Warn("inventory: partition lease not taken", "partition", p, "err", err)
			}
			continue
		}
		o.mu.Lock()
		o.held[p] = lease{rev: rev, sent: sent}
		o.mu.Unlock()
		got = append(got, p)
	}
	return got
}

// share is ceil(partitions / live replicas), this one counted.
func (o *owners) share() int {
	live := o.replicas()
	return (events.InventoryPartitions + live - 1) / live
}

// replicas is how many replicas are live by their member keys, this one counted.
func (o *owners) replicas() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	live := 1
	self := events.InventoryMemberKey(o.replica)
	for k, v := range o.seen {
		if strings.HasPrefix(k, "r.") && k != self && v.live(o.now()) {
			live++
		}
	}
	return live
}

// candidate is a partition to take: free, or leased in this replica's name (mine, at rev).
type candidate struct {
	p    int
	mine bool
	rev  uint64
}

// free lists the partitions this replica may take, lowest first: those no live lease names, and those
// whose lease names this replica without its holding it (a restart under the same name).
func (o *owners) free() []candidate {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []candidate
	for p := range events.InventoryPartitions {
		if _, held := o.held[p]; held {
			continue
		}
		v, ok := o.seen[events.InventoryLeaseKey(p)]
		switch {
		case ok && v.live(o.now()) && v.value == o.replica:
			out = append(out, candidate{p: p, mine: true, rev: v.rev})
		case ok && v.live(o.now()):
		default:
			out = append(out, candidate{p: p})
		}
	}
	return out
}

// valid reports whether this replica holds partition p's lease and renewed it recently enough that no
// other replica can have taken it: only then does it answer for p.
func (o *owners) valid(p int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	l, ok := o.held[p]
	return ok && o.now().Sub(l.sent) < ownersTTL-ownersMargin
}

func (o *owners) heldSorted() []int {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]int, 0, len(o.held))
	for p := range o.held {
		out = append(out, p)
	}
	sort.Ints(out)
	return out
}

// drop forgets the leases of ps and returns them.
func (o *owners) drop(ps []int) map[int]lease {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make(map[int]lease, len(ps))
	for _, p := range ps {
		out[p] = o.held[p]
		delete(o.held, p)
	}
	return out
}

// release deletes the leases given up, each only if it is still the revision this replica wrote.
func (o *owners) release(ctx context.Context, gone map[int]lease) {
	for p, l := range gone {
		if err := o.kv.DeleteIf(ctx, events.InventoryLeaseKey(p), l.rev); err != nil && !errors.Is(err, bus.ErrConflict) && ctx.Err() == nil {
			o.log.Warn("inventory: partition lease not released; it expires", "partition", p, "err", err)
		}
	}
}

// releaseAll gives up every lease at stop, on a context of its own (the run's has ended).
func (o *owners) releaseAll() {
	held := o.heldSorted()
	gone := o.drop(held)
	if len(held) > 0 {
		o.change(nil, held)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	o.release(ctx, gone)
	_ = o.kv.Delete(ctx, events.InventoryMemberKey(o.replica))
}
