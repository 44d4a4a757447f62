package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func runPartitioned(t *testing.T, b *bus.Bus, replica string) (*fleet.Inventory, func()) {
	t.Helper()
	inv, err := fleet.NewInventory(t.Context(), fleet.InventoryConfig{Replica: replica, Partitioned: true}, b)
	if err != nil {
		t.Fatal(err)
	}
	return inv, bustest.RunService(t, inv)
}

// partitionedBacklog publishes nodes x images image.detected events (node names with dots among them, so the
// node token is what is hashed), then removes image 0 from every third node: a later event of the same key.
// It returns the events in publish order (their events-stream sequences are 1..n on a fresh server).
func partitionedBacklog(t *testing.T, b *bus.Bus, nodes, images int) []events.Event {
	t.Helper()
	var evs []events.Event
	for n := range nodes {
		node := fmt.Sprintf("n%03d", n)
		if n%4 == 0 {
			node = fmt.Sprintf("n%03d.zone-a.example", n)
		}
		for i := range images {
			evs = append(evs, detected(t, node, fmt.Sprintf("sha256:%064x", i), fmt.Sprintf("img/%d:1", i), int64(1000+i)))
		}
	}
	for n := 0; n < nodes; n += 3 {
		evs = append(evs, imageEvent(t, evs[n*images].Node, events.ActionRemoved,
			events.ImageRemoved{ID: fmt.Sprintf("sha256:%064x", 0), Size: 1000, Reason: "space"}))
	}
	if err := b.PublishAll(t.Context(), evs); err != nil {
		t.Fatal(err)
	}
	return evs
}

// wantBucket is the bucket the events should leave: per key, the placement of the latest event (by stream
// sequence, 1-based in publish order).
func wantBucket(t *testing.T, evs []events.Event) map[string]events.Placement {
	t.Helper()
	want := map[string]events.Placement{}
	for i, ev := range evs {
		var r struct {
			ID string `json:"id"`
		}
		if err := ev.DecodeData(&r); err != nil {
			t.Fatal(err)
		}
		want[events.InventoryKey(r.ID, ev.Node)] = events.Placement{Node: ev.Node, ID: r.ID, Seq: uint64(i + 1),
			Gone: strings.HasSuffix(ev.Type, "."+events.ActionRemoved+".v1")}
	}
	return want
}

// bucketEntries reads the inventory bucket: every key's placement, live or gone.
func bucketEntries(t *testing.T, b *bus.Bus) map[string]events.Placement {
	t.Helper()
	kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: events.InventoryBucket})
	if err != nil {
		t.Fatal(err)
	}
	entries, err := kv.List(t.Context(), ">")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]events.Placement{}
	for _, e := range entries {
		var p events.Placement
		if err := json.Unmarshal(e.Value, &p); err != nil {
			t.Fatalf("key %s: %v", e.Key, err)
		}
		got[e.Key] = p
	}
	return got
}

// checkBucket compares the inventory bucket with want: every key there, each with the latest event's
// sequence (the events stream's, whichever way the event reached the replica) and liveness.
func checkBucket(t *testing.T, b *bus.Bus, want map[string]events.Placement) {
	t.Helper()
	got := bucketEntries(t, b)
	if len(got) != len(want) {
		t.Errorf("bucket holds %d keys, want %d", len(got), len(want))
	}
	for k, w := range want {
		g, ok := got[k]
		switch {
		case !ok:
			t.Errorf("key %s missing", k)
		case g.Seq != w.Seq || g.Gone != w.Gone || g.Node != w.Node || g.ID != w.ID:
			t.Errorf("key %s = node %s seq %d gone %v, want node %s seq %d gone %v", k, g.Node, g.Seq, g.Gone, w.Node, w.Seq, w.Gone)
		}
	}
}

// partitionsDrained reports whether every partition durable has nothing pending or in flight and the copy
// stream holds no copy (work queue: an acked copy is removed).
func partitionsDrained(ctx context.Context, b *bus.Bus) bool {
	for p := range events.InventoryPartitions {
		st, err := b.Consumer(ctx, events.InventoryStream, events.InventoryPartitionDurable(p))
		if err != nil || st.NumPending != 0 || st.NumAckPending != 0 {
			return false
		}
	}
	info, err := b.Stream(ctx, events.InventoryStream)
	return err == nil && info.Messages == 0
}

// TestInventoryPartitionCopiesKeepTheEventsSequence: the server's copy of every image event lands in the
// partition events.InventoryPartition computes (so the transform and the inventory agree), under
// InventoryCopySubject, and carries the events stream's sequence; other events are not copied.
func TestInventoryPartitionCopiesKeepTheEventsSequence(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	if err := fleet.EnsureInventoryStream(ctx, b, 0); err != nil {
		t.Fatal(err)
	}
	evs := partitionedBacklog(t, b, 40, 2)
	if err := b.Publish(ctx, imageEventOf(t, "n-pod", events.EntityPod, events.ActionAdded)); err != nil {
		t.Fatal(err)
	}
	want := len(evs)
	bustest.WaitFor(t, "every image event copied", func() bool {
		info, err := b.Stream(ctx, events.InventoryStream)
		return err == nil && info.Messages >= uint64(want)
	})
	if info, _ := b.Stream(ctx, events.InventoryStream); info.Messages != uint64(want) {
		t.Fatalf("copy stream holds %d messages, want %d (image events only)", info.Messages, want)
	}
	// A work queue is read by a consumer that acks (which removes what it read).
	var mu sync.Mutex
	parts := map[int]bool{}
	seen := map[uint64]bool{}
	stop := bustest.RunFunc(t, "probe", func(ctx context.Context) error {
		return b.Consume(ctx, bus.ConsumerConfig{Stream: events.InventoryStream, Durable: "probe"}, func(_ context.Context, m *bus.Msg) error {
			seq, err := events.SourceSequence(m.Header.Get("Nats-Stream-Source"), events.EventsStream)
			if err != nil || seq < 1 || seq > uint64(len(evs)) {
				t.Errorf("copy %s: sequence %d: %v", m.Subject, seq, err)
				return nil
			}
			ev := evs[seq-1]
			action := ev.Type[len("imagefleet.image.") : len(ev.Type)-len(".v1")]
			if wantSubj := events.InventoryCopySubject(ev.Node, action); m.Subject != wantSubj {
				t.Errorf("copy of seq %d (node %s) under %s, want %s", seq, ev.Node, m.Subject, wantSubj)
			}
			mu.Lock()
			parts[events.InventoryPartition(ev.Node)] = true
			seen[seq] = true
			mu.Unlock()
			return nil
		})
	})
	bustest.WaitFor(t, "every copy read", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == want
	})
	stop()
	if len(parts) < events.InventoryPartitions/2 {
		t.Fatalf("40 nodes fell in %d partitions: the hash does not spread them", len(parts))
	}
}

func imageEventOf(t *testing.T, node, entity, action string) events.Event {
	t.Helper()
	ev, err := events.New(node, entity, action, map[string]string{"name": "p"})
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// TestInventoryPartitionedReplicasApplyEveryEventOnce: with 1, 2 and 3 replicas on the partition durables,
// every image event is applied exactly once (no event lost, none applied twice) and the bucket holds the
// latest event of every key with its events-stream sequence.
func TestInventoryPartitionedReplicasApplyEveryEventOnce(t *testing.T) {
	for _, replicas := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("replicas=%d", replicas), func(t *testing.T) {
			bustest.VerifyNoLeaks(t)
			_, b := bustest.Start(t)
			ctx := t.Context()
			evs := partitionedBacklog(t, b, 60, 10)
			var invs []*fleet.Inventory
			var stops []func()
			for r := range replicas {
				inv, stop := runPartitioned(t, b, fmt.Sprintf("r%d", r+1))
				invs, stops = append(invs, inv), append(stops, stop)
			}
			var applied, dups int64
			bustest.WaitWithin(t, "every event applied and every partition drained", time.Minute, func() bool {
				applied, dups = 0, 0
				for _, inv := range invs {
					st := inv.Stats()
					applied += st.Applied
					dups += st.Duplicates
				}
				return applied+dups >= int64(len(evs)) && partitionsDrained(ctx, b)
			})
			// Each key's events are in one partition, in order, but two replicas may hold two of them at
			// once: the later one first makes the earlier a duplicate. Applied + duplicates is every event,
			// once.
			if applied+dups != int64(len(evs)) || applied < int64(len(wantBucket(t, evs))) {
				t.Fatalf("applied %d + duplicates %d, want %d events, at least %d applied", applied, dups, len(evs), len(wantBucket(t, evs)))
			}
			checkBucket(t, b, wantBucket(t, evs))
			for _, stop := range stops {
				stop()
			}
		})
	}
}

// TestInventoryPartitionedReplicaKilledMidCatchUpLosesNothing: a replica whose connection dies while it
// holds events in flight (no ack, no hand-back) loses none: another replica gets them after the ack wait.
func TestInventoryPartitionedReplicaKilledMidCatchUpLosesNothing(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	srv, b := bustest.Start(t)
	ctx := t.Context()
	evs := partitionedBacklog(t, b, 200, 20)
	// The doomed replica reaches the server through a proxy whose connections are cut mid-run: a kill,
	// as far as the server can tell (no ack, no hand-back, no unsubscribe).
	px := startCutProxy(t, srv.ClientURL())
	doomed, err := bus.Connect(ctx, px.url, bus.Options{Name: "doomed"})
	if err != nil {
		t.Fatal(err)
	}
	defer doomed.Close()
	r1, err := fleet.NewInventory(ctx, fleet.InventoryConfig{Replica: "doomed", Partitioned: true}, doomed)
	if err != nil {
		t.Fatal(err)
	}
	// The cut must come while most events are left, and a replica applies thousands a second: the proxy
	// freezes the doomed replica's connections (passes nothing more either way) once it has applied 200,
	// checked before each read from the server reaches it, so it cannot apply the rest before the cut
	// however the goroutines are scheduled.
	px.freezeWhen(func() bool { return r1.Stats().Applied >= 200 })
	stop1 := bustest.RunService(t, r1)
	bustest.WaitWithin(t, "the doomed replica frozen after 200 events", time.Minute, px.frozen)
	px.cut()
	killedAt := r1.Stats().Applied
	if killedAt >= int64(len(evs)) {
		t.Fatalf("the doomed replica applied all %d events before it was killed: nothing left to lose", killedAt)
	}
	r2, stop2 := runPartitioned(t, b, "survivor")
	defer stop2()
	bustest.WaitWithin(t, "every partition drained by the survivor", time.Minute, func() bool {
		st := r2.Stats()
		return r1.Stats().Applied+st.Applied+st.Duplicates >= int64(len(evs)) && partitionsDrained(ctx, b)
	})
	stop1()
	t.Logf("killed after %d applied; the survivor applied %d, %d duplicates", killedAt, r2.Stats().Applied, r2.Stats().Duplicates)
	checkBucket(t, b, wantBucket(t, evs))
}

// TestInventoryPartitionedBesideTheSharedDurable: a replica of the previous release (the shared durable on
// the events stream) runs beside a partitioned one during an upgrade: both apply every event, each guarded
// by the events stream's sequence, so the bucket ends exactly as either alone would leave it.
func TestInventoryPartitionedBesideTheSharedDurable(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	old, err := fleet.NewInventory(ctx, fleet.InventoryConfig{Replica: "old"}, b)
	if err != nil {
		t.Fatal(err)
	}
	stopOld := bustest.RunService(t, old)
	cur, stopNew := runPartitioned(t, b, "new")
	var wg sync.WaitGroup
	wg.Add(1)
	var evs []events.Event
	go func() { // published while both run
		defer wg.Done()
		evs = partitionedBacklog(t, b, 50, 10)
	}()
	wg.Wait()
	bustest.WaitWithin(t, "both drained", time.Minute, func() bool {
		so, sn := old.Stats(), cur.Stats()
		if so.Applied+so.Duplicates < int64(len(evs)) || sn.Applied+sn.Duplicates < int64(len(evs)) {
			return false
		}
		st, err := b.Consumer(ctx, events.EventsStream, events.InventoryDurable)
		return err == nil && st.NumPending == 0 && st.NumAckPending == 0 && partitionsDrained(ctx, b)
	})
	so, sn := old.Stats(), cur.Stats()
	if so.Applied+so.Duplicates != int64(len(evs)) || sn.Applied+sn.Duplicates != int64(len(evs)) {
		t.Fatalf("old replica %+v, new replica %+v: each should see all %d events", so, sn, len(evs))
	}
	checkBucket(t, b, wantBucket(t, evs))
	stopNew()
	stopOld()
}

// cutProxy forwards TCP connections to a server until cut, which closes them all and refuses new ones. Once
// the condition given to freezeWhen holds (checked before each read from the server is passed on), it passes
// nothing more either way until the cut: the client's connection goes silent at that point.
type cutProxy struct {
	url        string
	ln         net.Listener
	mu         sync.Mutex
	conns      []net.Conn
	freezeCond atomic.Pointer[func() bool]
	freeze     sync.Once
	isFrozen   chan struct{}
}

func (px *cutProxy) freezeWhen(cond func() bool) { px.freezeCond.Store(&cond) }

// frozen reports whether the proxy has frozen its connections.
func (px *cutProxy) frozen() bool {
	select {
	case <-px.isFrozen:
		return true
	default:
		return false
	}
}

// pass copies src to dst until either fails; from the freeze on, it reads src and passes nothing. Only the
// server's side checks the condition (toClient).
func (px *cutProxy) pass(dst io.Writer, src io.Reader, toClient bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if cond := px.freezeCond.Load(); toClient && cond != nil && (*cond)() {
				px.freeze.Do(func() { close(px.isFrozen) })
			}
			if !px.frozen() {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

func startCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	addr := strings.TrimPrefix(target, "nats://")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	px := &cutProxy{url: "nats://" + ln.Addr().String(), ln: ln, isFrozen: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", addr)
			if err != nil {
				c.Close()
				continue
			}
			px.mu.Lock()
			px.conns = append(px.conns, c, s)
			px.mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); px.pass(s, c, false); s.Close() }()
			go func() { defer wg.Done(); px.pass(c, s, true); c.Close() }()
		}
	}()
	t.Cleanup(func() { px.cut(); wg.Wait() })
	return px
}

func (px *cutProxy) cut() {
	px.ln.Close()
	px.mu.Lock()
	defer px.mu.Unlock()
	for _, c := range px.conns {
		c.Close()
	}
}

// TestInventoryUpdateIsOneRequestPerEvent: when nodes restart and report images the bucket already holds
// (later events of existing keys), a replica writes each with one compare-and-set on the revision its index
// holds, not a create that conflicts, a get and an update. Counted as the messages clients hand the server
// while a fresh replica applies them: one write and one ack per event, plus pull requests. The partitions'
// acks are plain acks, which nothing waits for: the server answers none of them (counted as the messages the
// server sends per event: 4.05 against 5.05 when every ack waited for its reply).
func TestInventoryUpdateIsOneRequestPerEvent(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	srv, b := bustest.Start(t)
	ctx := t.Context()
	const nodes, images = 200, 5
	publish := func(size int64) int {
		var evs []events.Event
		for n := range nodes {
			for i := range images {
				evs = append(evs, detected(t, fmt.Sprintf("n%03d", n), fmt.Sprintf("sha256:%064x", i), "img:1", size))
			}
		}
		if err := b.PublishAll(ctx, evs); err != nil {
			t.Fatal(err)
		}
		return len(evs)
	}
	first := publish(100)
	r1, stop1 := runPartitioned(t, b, "first")
	bustest.WaitWithin(t, "the first round applied and acked", time.Minute, func() bool {
		return r1.Stats().Applied == int64(first) && partitionsDrained(ctx, b)
	})
	stop1()
	second := publish(200) // the restart: every key again, later sequences
	bustest.WaitFor(t, "the second round copied", func() bool {
		info, err := b.Stream(ctx, events.InventoryStream)
		return err == nil && info.Messages >= uint64(second)
	})
	in0, out0, err := srv.MsgCounts()
	if err != nil {
		t.Fatal(err)
	}
	r2, stop2 := runPartitioned(t, b, "second")
	defer stop2()
	bustest.WaitWithin(t, "the second round applied", time.Minute, func() bool {
		return r2.Stats().Applied == int64(second) && partitionsDrained(ctx, b)
	})
	in1, out1, err := srv.MsgCounts()
	if err != nil {
		t.Fatal(err)
	}
	perEvent, outPerEvent := float64(in1-in0)/float64(second), float64(out1-out0)/float64(second)
	t.Logf("%.2f messages to the server per event (%d for %d events), %.2f from it", perEvent, in1-in0, second, outPerEvent)
	// Out per event (server varz out_msgs): the delivery, the write's reply, the watch's copy of the write and
	// one more the server counts (4.05 measured); a double ack's reply is one more (5.05).
	if outPerEvent > 4.5 {
		t.Errorf("%.2f messages from the server per event: the server answers the partitions' acks (a double ack waits for that answer)", outPerEvent)
	}
	// A write and an ack are 2; pull requests, the watch and the consumers' setup add a few tenths. Create,
	// get and update would be 4 with the ack.
	if perEvent > 3 {
		t.Fatalf("%.2f messages to the server per event: more than one write per event", perEvent)
	}
}
