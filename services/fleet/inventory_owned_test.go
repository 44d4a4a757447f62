package fleet_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// ownedQueries are the queries the partitioned tests compare, each paged at several limits.
func ownedQueries() []events.InventoryQuery {
	return []events.InventoryQuery{
		{What: events.InventoryImages},
		{What: events.InventoryNodes},
		{What: events.InventoryWhere, Image: fmt.Sprintf("sha256:%064x", 3)},
		{What: events.InventoryWhere, Image: "img/5:1"},
		{What: events.InventoryWhere, Image: "sha256:000000"}, // a prefix of every image
	}
}

// pages reads every page of q at limit from ask, joined; it fails when the pages repeat or do not end.
func pages(t *testing.T, q events.InventoryQuery, limit int, ask func(events.InventoryQuery) (events.InventoryReply, error)) []events.InventoryReply {
	t.Helper()
	q.Limit = limit
	var out []events.InventoryReply
	for i := 0; ; i++ {
		if i > 10000 {
			t.Fatalf("%+v: pages do not end", q)
		}
		rep, err := ask(q)
		if err != nil {
			t.Fatalf("%+v: %v", q, err)
		}
		rep.Replica = ""
		out = append(out, rep)
		if rep.Continue == "" {
			return out
		}
		q.Continue = rep.Continue
	}
}

// TestMergedPartsAreTheWholeAnswer: parts answered from any split of the partitions over replicas merge into
// exactly the answer of one replica holding everything, page by page (where and nodes are paged at each
// part, images only after the merge).
func TestMergedPartsAreTheWholeAnswer(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var all []events.Placement
	for n := range 150 {
		node := fmt.Sprintf("node-%03d.zone-%d", n, n%3)
		for i := range 12 {
			if rng.IntN(3) == 0 {
				continue
			}
			all = append(all, events.Placement{Node: node, ID: fmt.Sprintf("sha256:%064x", i),
				RepoTags: []string{fmt.Sprintf("img/%d:1", i)}, RepoDigests: []string{fmt.Sprintf("img/%d@sha256:%064x", i, n%4)},
				Size: int64(1000 + i*10 + n%7), LastUsed: time.Unix(int64(1700000000+rng.IntN(1000)), 0).UTC()})
		}
	}
	for _, replicas := range []int{1, 2, 3, 5} {
		owner := map[int]int{} // partition -> replica
		for p := range events.InventoryPartitions {
			owner[p] = rng.IntN(replicas)
		}
		held := make([][]events.Placement, replicas)
		for _, p := range all {
			r := owner[events.InventoryPartition(p.Node)]
			held[r] = append(held[r], p)
		}
		parted := func(q events.InventoryQuery) (events.InventoryReply, error) {
			var parts []events.InventoryPart
			for r := range replicas {
				pq := q
				if q.What == events.InventoryImages {
					pq = events.InventoryQuery{What: events.InventoryImages}
				}
				rep, err := fleet.Answer(pq, held[r])
				if err != nil {
					return rep, err
				}
				part := events.InventoryPart{Replica: fmt.Sprint(r), Reply: rep}
				for p, o := range owner {
					if o == r {
						part.Partitions = append(part.Partitions, p)
					}
				}
				parts = append(parts, part)
			}
			return fleet.MergeParts(q, parts)
		}
		whole := func(q events.InventoryQuery) (events.InventoryReply, error) { return fleet.Answer(q, all) }
		for _, q := range ownedQueries() {
			for _, limit := range []int{0, 1, 7, 100} {
				got, want := pages(t, q, limit, parted), pages(t, q, limit, whole)
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("%d replicas, %+v limit %d: merged pages differ from one replica's\n got %+v\nwant %+v", replicas, q, limit, got, want)
				}
			}
		}
	}
}

// bucketPlacements reads the live placements of the inventory bucket.
func bucketPlacements(t *testing.T, b *bus.Bus) []events.Placement {
	t.Helper()
	entries := bucketEntries(t, b)
	var out []events.Placement
	for _, k := range slices.Sorted(maps.Keys(entries)) { // in key order, as the bucket lists them
		if p := entries[k]; !p.Gone {
			out = append(out, p)
		}
	}
	return out
}

// checkOwned waits until the replicas own every partition once, each its share (within one), and index
// only the placements of their own partitions, all of them.
func checkOwned(t *testing.T, invs []*fleet.Inventory, placements int) {
	t.Helper()
	share := (events.InventoryPartitions + len(invs) - 1) / len(invs)
	bustest.WaitWithin(t, fmt.Sprintf("%d replicas own the 16 partitions", len(invs)), 45*time.Second, func() bool {
		var owned []int
		indexed := 0
		for _, inv := range invs {
			o := inv.Owned()
			if len(o) < share-1 || len(o) > share {
				return false
			}
			owned = append(owned, o...)
			n, foreign := inv.Indexed()
			if foreign != 0 {
				t.Fatalf("a replica owning %v indexes %d placements of other partitions", o, foreign)
			}
			indexed += n
		}
		slices.Sort(owned)
		return len(owned) == events.InventoryPartitions && slices.Equal(slices.Compact(owned), owned) && indexed == placements
	})
}

// checkQueries compares the inventory's answers (gathered from the replicas' parts) with one computed from
// the bucket's placements, every page.
func checkQueries(t *testing.T, b *bus.Bus, placements []events.Placement) {
	t.Helper()
	ask := func(q events.InventoryQuery) (events.InventoryReply, error) {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		var rep events.InventoryReply
		err := b.Request(ctx, events.InventoryQuerySubject, q, &rep)
		return rep, err
	}
	whole := func(q events.InventoryQuery) (events.InventoryReply, error) { return fleet.Answer(q, placements) }
	for _, q := range ownedQueries() {
		for _, limit := range []int{0, 9} {
			got, want := pages(t, q, limit, ask), pages(t, q, limit, whole)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%+v limit %d: the inventory answered\n%+v\nwant\n%+v", q, limit, got, want)
			}
		}
	}
}

// TestInventoryPartitionedReplicasOwnAndAnswerTheirShare: partitioned replicas split the 16 partitions, each
// indexes only its own, and a query is answered whole from their parts; when a replica stops its partitions
// are taken over, and when one joins it gets its share, with the answers whole again and new events applied.
func TestInventoryPartitionedReplicasOwnAndAnswerTheirShare(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	evs := partitionedBacklog(t, b, 60, 10)
	r1, stop1 := runPartitioned(t, b, "r1")
	defer stop1()
	r2, stop2 := runPartitioned(t, b, "r2")
	bustest.WaitWithin(t, "the backlog applied", time.Minute, func() bool {
		s1, s2 := r1.Stats(), r2.Stats()
		return s1.Applied+s1.Duplicates+s2.Applied+s2.Duplicates >= int64(len(evs)) && partitionsDrained(ctx, b)
	})
	checkBucket(t, b, wantBucket(t, evs))
	live := bucketPlacements(t, b)
	checkOwned(t, []*fleet.Inventory{r1, r2}, len(live))
	checkQueries(t, b, live)

	// r2 stops: it gives its partitions up, and r1 takes them over and reads them from the bucket.
	stop2()
	checkOwned(t, []*fleet.Inventory{r1}, len(live))
	checkQueries(t, b, live)

	// r3 joins: r1 gives up its share and r3 takes it. Events published meanwhile are applied once.
	r3, stop3 := runPartitioned(t, b, "r3")
	defer stop3()
	more := []events.Event{}
	for n := range 40 {
		more = append(more, detected(t, fmt.Sprintf("late-%02d", n), fmt.Sprintf("sha256:%064x", 3), "img/3:1", 1003))
	}
	if err := b.PublishAll(ctx, more); err != nil {
		t.Fatal(err)
	}
	bustest.WaitWithin(t, "the late events applied", time.Minute, func() bool {
		return len(bucketPlacements(t, b)) == len(live)+len(more) && partitionsDrained(ctx, b)
	})
	live = bucketPlacements(t, b)
	checkOwned(t, []*fleet.Inventory{r1, r3}, len(live))
	checkQueries(t, b, live)
}

// TestInventoryPartitionedGatherWaitsForEveryPartition: a query is answered only from parts covering every
// partition once. A replica that stopped without giving its leases up (here a fake one, its keys written
// by the test) leaves its partitions unanswered until the leases expire: the query is refused with
// events.ErrPartsMissing naming them, not answered from part of the fleet. Two parts claiming one partition
// before every partition is covered are refused too (an impostor answering for the stopped replica's
// partitions and one of r1's, so no answer can be whole without it). Then the partitions are taken over.
func TestInventoryPartitionedGatherWaitsForEveryPartition(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	partitionedBacklog(t, b, 20, 2)
	renew := goneReplica(t, b)
	renew()
	rctx, stopRenewing := context.WithCancel(ctx)
	renewed := make(chan struct{})
	go func() { // the fake replica keeps its leases until told to stop
		defer close(renewed)
		for {
			select {
			case <-rctx.Done():
				return
			case <-time.After(2 * time.Second):
				renew()
			}
		}
	}()
	r1, stop1 := runPartitioned(t, b, "r1")
	defer stop1()
	bustest.WaitWithin(t, "r1 owns its share", 30*time.Second, func() bool { return len(r1.Owned()) == 8 })
	nodes := func() (events.InventoryReply, error) {
		qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		var rep events.InventoryReply
		err := b.Request(qctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryNodes}, &rep)
		return rep, err
	}
	start := time.Now()
	_, err := nodes()
	if !errors.Is(err, events.ErrPartsMissing) || !strings.Contains(err.Error(), "[8 9 10 11 12 13 14 15]") {
		t.Fatalf("with partitions 8-15 held by a stopped replica: %v, want ErrPartsMissing naming them", err)
	}
	t.Logf("refused after %s: %v", time.Since(start).Round(time.Millisecond), err)
	// An impostor answering for partitions 8-15 and for r1's partition 3: the parts cover every partition
	// only with both, so each round sees 3 twice, and the query is refused rather than counted twice.
	ictx, stopImpostor := context.WithCancel(ctx)
	impostorDone := make(chan struct{})
	go func() {
		defer close(impostorDone)
		_ = b.ServeConcurrent(ictx, events.InventoryPartsSubject, "", 1, func(context.Context, []byte) (any, error) {
			return events.InventoryPart{Replica: "impostor", Partitions: []int{3, 8, 9, 10, 11, 12, 13, 14, 15}}, nil
		})
	}()
	bustest.WaitWithin(t, "the query refused with partition 3 answered twice", 40*time.Second, func() bool {
		_, err := nodes()
		if !errors.Is(err, events.ErrPartsMissing) {
			t.Fatalf("with partition 3 answered twice: %v, want ErrPartsMissing", err)
		}
		return strings.Contains(err.Error(), "partitions [3] answered by two replicas")
	})
	stopImpostor()
	<-impostorDone
	// Not renewed any more: the leases expire and r1 takes the partitions over.
	stopRenewing()
	<-renewed
	bustest.WaitWithin(t, "r1 takes the expired partitions", 40*time.Second, func() bool { return len(r1.Owned()) == events.InventoryPartitions })
	// Nobody consumed partitions 8-15 while the stopped replica held them: r1 answers for them once it has
	// read their placements from the bucket (none), and their nodes appear as it works through their
	// backlog. Every answer is whole from then on, and never counts a node twice.
	bustest.WaitWithin(t, "every node answered for", 40*time.Second, func() bool {
		rep, err := nodes()
		if err != nil {
			t.Fatalf("with every partition held by r1: %v", err)
		}
		if rep.Total > 20 {
			t.Fatalf("nodes total %d, want at most 20", rep.Total)
		}
		return rep.Total == 20
	})
}

// TestInventoryPartitionedTakeoverRekeysNodeFirstKeys: a replica of the previous release, still running
// during an upgrade, writes a node-first key into a partition whose owner then goes away. The replica that
// takes the partition over finds the key in its read of the bucket and re-keys it (its watch had passed the
// key over, as the partition was not its own), so the bucket does not keep the old layout until a restart.
func TestInventoryPartitionedTakeoverRekeysNodeFirstKeys(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	if err := fleet.EnsureBuckets(ctx, b, 1); err != nil {
		t.Fatal(err)
	}
	kv, err := b.KVExisting(ctx, events.InventoryBucket)
	if err != nil {
		t.Fatal(err)
	}
	// A node of the partitions 8-15, which a stopped replica holds until its leases expire.
	node := ""
	for i := 0; node == ""; i++ {
		if n := fmt.Sprintf("old-%d.example", i); events.InventoryPartition(n) >= 8 {
			node = n
		}
	}
	lease := goneReplica(t, b)
	lease()
	r1, stop1 := runPartitioned(t, b, "r1")
	defer stop1()
	bustest.WaitWithin(t, "r1 owns its share", 30*time.Second, func() bool { return len(r1.Owned()) == 8 })
	id := fmt.Sprintf("sha256:%064x", 7)
	putPlacement(t, kv, events.InventoryNodeFirstKey(node, id),
		events.Placement{Node: node, ID: id, RepoTags: []string{"img/7:1"}, Size: 700, Seq: 1})
	lease() // renewed once after the write, so r1's watch has long seen the key when the leases expire
	bustest.WaitWithin(t, "r1 takes the expired partitions", 40*time.Second, func() bool {
		return len(r1.Owned()) == events.InventoryPartitions
	})
	// The count is r1's own: it rises once the old key's deletion has returned, which is after the bucket
	// shows the new layout, so it is waited for with it. At least once: a key queued twice (a range read
	// again after an error) is re-keyed twice, harmlessly.
	bustest.WaitWithin(t, "the node-first key re-keyed, by r1", 30*time.Second, func() bool {
		keys, nodeFirst := bucketLayout(t, kv)
		return len(nodeFirst) == 0 && slices.Equal(keys, []string{events.InventoryKey(id, node)}) && r1.Stats().Rekeyed >= 1
	})
	if got, want := wherePlacements(t, b, "img/7:1"), []string{node + "/700"}; !slices.Equal(got, want) {
		t.Fatalf("where img/7:1 = %v, want %v", got, want)
	}
}

// goneReplica returns what renews the keys of a replica named gone that holds partitions 8-15 (its member
// key and their leases) without running: once the calls stop, its leases expire and the partitions are free.
func goneReplica(t *testing.T, b *bus.Bus) func() {
	t.Helper()
	ctx := t.Context()
	owners, err := b.KV(ctx, bus.KVConfig{Bucket: events.InventoryOwnersBucket, TTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return func() {
		if _, err := owners.Put(ctx, events.InventoryMemberKey("gone"), []byte("gone")); err != nil {
			t.Fatal(err)
		}
		for p := 8; p < events.InventoryPartitions; p++ {
			if _, err := owners.Put(ctx, events.InventoryLeaseKey(p), []byte("gone")); err != nil {
				t.Fatal(err)
			}
		}
	}
}
