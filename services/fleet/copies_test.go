package fleet_test

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"slices"
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

// TestCopiesArbiterNeverGrantsBelowTheCount: four nodes hold an image (two per zone) and ask at once to remove
// it; the arbiter, over a real NATS, grants exactly as many removals as leave the count: fleet-wide with
// count 2, two; per zone with count 1, one in each zone. A dry run records nothing; a node the inventory
// shows gone no longer counts, and its grant no longer holds a copy back.
func TestCopiesArbiterNeverGrantsBelowTheCount(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	const img = "sha256:1111111111111111111111111111111111111111111111111111111111111111"
	nodes := []string{"n1", "n2", "n3", "n4"}
	zones := map[string]map[string]string{"n1": {"zone": "a"}, "n2": {"zone": "a"}, "n3": {"zone": "b"}, "n4": {"zone": "b"}}
	inv, err := b.KV(ctx, bus.KVConfig{Bucket: events.InventoryBucket})
	if err != nil {
		t.Fatal(err)
	}
	place := func(node string, gone bool) {
		raw, _ := json.Marshal(events.Placement{Node: node, ID: img, Size: 10, Gone: gone})
		if _, err := inv.Put(ctx, events.InventoryKey(img, node), raw); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range nodes {
		place(n, false)
	}
	a := fleet.NewCopiesArbiter(b, fleet.CopiesConfig{GrantTTL: time.Hour,
		Labels: func(context.Context) (map[string]map[string]string, error) { return zones, nil }})
	bustest.RunFunc(t, "copies arbiter", a.Run)

	ask := func(node string, count int, key string, dryRun bool) (bool, int) {
		var rep events.CopiesReply
		req := events.CopiesRequest{Node: node, Images: []string{img}, Count: count, TopologyKey: key, Zone: zones[node]["zone"], DryRun: dryRun}
		bustest.Eventually(t, "the arbiter answers "+node, 10*time.Second, func() error {
			c, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			return b.Request(c, events.CopiesSubject(node), req, &rep)
		})
		return slices.Contains(rep.Allowed, img), rep.Copies[img]
	}
	allAtOnce := func(count int, key string) []string {
		var mu sync.Mutex
		var granted []string
		var wg sync.WaitGroup
		for _, n := range nodes {
			wg.Go(func() {
				if ok, _ := ask(n, count, key, false); ok {
					mu.Lock()
					granted = append(granted, n)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		slices.Sort(granted)
		return granted
	}
	resetLedger := func() {
		kv, err := b.KV(ctx, fleet.CopiesBucketConfig())
		if err != nil {
			t.Fatal(err)
		}
		if err := kv.Delete(ctx, events.InventoryImageToken(img)); err != nil {
			t.Fatal(err)
		}
	}

	if ok, copies := ask("n1", 3, "", true); !ok || copies != 4 {
		t.Errorf("dry run, count 3 of 4: allowed %v, copies %d", ok, copies)
	}
	if ok, _ := ask("n1", 4, "", true); ok {
		t.Error("dry run, count 4 of 4: allowed")
	}
	if got := allAtOnce(2, ""); len(got) != 2 {
		t.Errorf("fleet-wide count 2: granted %v, want 2 of 4", got)
	}
	resetLedger()
	got := allAtOnce(1, "zone")
	if len(got) != 2 || (slices.Contains(got, "n1") == slices.Contains(got, "n2")) || (slices.Contains(got, "n3") == slices.Contains(got, "n4")) {
		t.Errorf("per zone count 1: granted %v, want one of n1, n2 and one of n3, n4", got)
	}

	// The zone a's granted node is gone: the other zone-a node is its zone's last copy.
	gone, kept := got[0], "n2"
	if gone == "n2" {
		kept = "n1"
	}
	place(gone, true)
	if ok, copies := ask(kept, 1, "zone", false); ok || copies != 1 {
		t.Errorf("the last copy of zone a: allowed %v, copies %d", ok, copies)
	}
}

// copiesFleet is an arbiter over a real NATS with a clock the test moves, and an inventory where n1 and n2
// hold img.
type copiesFleet struct {
	t     *testing.T
	b     *bus.Bus
	inv   *bus.KV
	clock atomic.Int64 // the arbiter's Now, in Unix nanoseconds
}

const copiesImg = "sha256:2222222222222222222222222222222222222222222222222222222222222222"

func newCopiesFleet(t *testing.T) *copiesFleet {
	_, b := bustest.Start(t)
	inv, err := b.KV(t.Context(), bus.KVConfig{Bucket: events.InventoryBucket})
	if err != nil {
		t.Fatal(err)
	}
	f := &copiesFleet{t: t, b: b, inv: inv}
	f.clock.Store(time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	f.place("n1", 1, false)
	f.place("n2", 2, false)
	a := fleet.NewCopiesArbiter(b, fleet.CopiesConfig{GrantTTL: 10 * time.Minute,
		Now: func() time.Time { return time.Unix(0, f.clock.Load()) }})
	bustest.RunFunc(t, "copies arbiter", a.Run)
	bustest.Eventually(t, "the arbiter answers", 10*time.Second, func() error {
		return f.request(events.CopiesSubject("n1"), events.CopiesRequest{Node: "n1", Images: []string{copiesImg}, Count: 1, DryRun: true}, nil)
	})
	return f
}

// place writes node's placement of the image as the inventory does for an event of stream sequence seq.
func (f *copiesFleet) place(node string, seq uint64, gone bool) {
	raw, _ := json.Marshal(events.Placement{Node: node, ID: copiesImg, Size: 10, Seq: seq, Gone: gone})
	if _, err := f.inv.Put(f.t.Context(), events.InventoryKey(copiesImg, node), raw); err != nil {
		f.t.Fatal(err)
	}
}

func (f *copiesFleet) advance(d time.Duration) { f.clock.Add(int64(d)) }

func (f *copiesFleet) request(subject string, req events.CopiesRequest, rep any) error {
	ctx, cancel := context.WithTimeout(f.t.Context(), 5*time.Second)
	defer cancel()
	return f.b.Request(ctx, subject, req, rep)
}

// remove asks, as node's GC executor does, to remove the image keeping one copy in the fleet.
func (f *copiesFleet) remove(node string) bool {
	f.t.Helper()
	var rep events.CopiesReply
	if err := f.request(events.CopiesSubject(node), events.CopiesRequest{Node: node, Images: []string{copiesImg}, Count: 1}, &rep); err != nil {
		f.t.Fatalf("%s asks: %v", node, err)
	}
	return slices.Contains(rep.Allowed, copiesImg)
}

// grants are the nodes the ledger holds a grant for.
func (f *copiesFleet) grants() []string {
	f.t.Helper()
	kv, err := f.b.KV(f.t.Context(), fleet.CopiesBucketConfig())
	if err != nil {
		f.t.Fatal(err)
	}
	raw, _, err := kv.Get(f.t.Context(), events.InventoryImageToken(copiesImg))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return nil
	}
	if err != nil {
		f.t.Fatal(err)
	}
	var l struct {
		Grants map[string]time.Time `json:"grants"`
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		f.t.Fatal(err)
	}
	return slices.Sorted(maps.Keys(l.Grants))
}

// TestCopiesGrantEndsOnEvidence: n1 and n2 hold an image, one copy must stay, n1's removal is granted. The
// grant keeps n1's copy uncounted (n2 is refused) until there is evidence that n1's removal did not happen:
// not when GrantTTL passes with the inventory as it was (it may lag the removal: the worker down for longer),
// but when, past GrantTTL, the inventory shows n1's image written again since the grant, or at once when n1
// gives the grant back because its removal failed. The inventory showing n1's image gone ends it too, and
// n2 is then the last copy.
func TestCopiesGrantEndsOnEvidence(t *testing.T) {
	for _, tc := range []struct {
		name string
		// then acts after n1's grant and, before it, what n2 is told.
		then      func(f *copiesFleet)
		n2Allowed bool
	}{
		{"stale inventory past GrantTTL", func(f *copiesFleet) { f.advance(10*time.Minute + time.Second) }, false},
		{"placement rewritten past GrantTTL", func(f *copiesFleet) {
			f.advance(10*time.Minute + time.Second)
			if f.remove("n2") {
				f.t.Fatal("past GrantTTL, before n1's placement is written again: n2 allowed")
			}
			f.place("n1", 3, false)
		}, true},
		{"placement rewritten within GrantTTL", func(f *copiesFleet) { f.place("n1", 3, false); f.advance(time.Minute) }, false},
		{"released", func(f *copiesFleet) {
			if err := f.request(events.CopiesSubject("n1"), events.CopiesRequest{Node: "n1", Images: []string{copiesImg}, Release: true}, nil); err != nil {
				f.t.Fatalf("n1 releases: %v", err)
			}
			if g := f.grants(); len(g) != 0 {
				f.t.Fatalf("after n1's release the ledger holds %v", g)
			}
		}, true},
		{"placement gone", func(f *copiesFleet) { f.place("n1", 3, true) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newCopiesFleet(t)
			if !f.remove("n1") {
				t.Fatal("n1, one of two copies with count 1: refused")
			}
			if g := f.grants(); !slices.Equal(g, []string{"n1"}) {
				t.Fatalf("grants %v, want n1's", g)
			}
			tc.then(f)
			if got := f.remove("n2"); got != tc.n2Allowed {
				t.Errorf("n2 allowed %v, want %v (grants %v)", got, tc.n2Allowed, f.grants())
			}
		})
	}
}

// TestCopiesNodeAsksOnItsOwnSubjectOnly: the arbiter takes a request's node from its subject, which the
// NATS permissions tie to the sender. A request on n1's subject naming n2 is refused as malformed and
// records nothing; a node whose name has dots asks on its token's subject as usual.
func TestCopiesNodeAsksOnItsOwnSubjectOnly(t *testing.T) {
	f := newCopiesFleet(t)
	err := f.request(events.CopiesSubject("n1"), events.CopiesRequest{Node: "n2", Images: []string{copiesImg}, Count: 1}, &events.CopiesReply{})
	if !errors.Is(err, events.ErrMalformed) || !strings.Contains(err.Error(), "own subject") {
		t.Errorf("n2's request on n1's subject: err %v, want one wrapping ErrMalformed", err)
	}
	err = f.request(events.CopiesSubject("n1"), events.CopiesRequest{Node: "n2", Images: []string{copiesImg}, Release: true}, nil)
	if !errors.Is(err, events.ErrMalformed) {
		t.Errorf("n2's release on n1's subject: err %v, want one wrapping ErrMalformed", err)
	}
	if g := f.grants(); len(g) != 0 {
		t.Errorf("after the refused request the ledger holds %v", g)
	}

	f.place("n3.zone-a", 4, false)
	if !f.remove("n3.zone-a") {
		t.Error("n3.zone-a on its own subject, one of three copies with count 1: refused")
	}
	if g := f.grants(); !slices.Equal(g, []string{"n3.zone-a"}) {
		t.Errorf("grants %v, want n3.zone-a's", g)
	}
}

// TestCopiesReadsOlderGrants: a grant an older arbiter wrote (its time, no placement Seq) keeps its node's
// copy uncounted until that time, and ends then, as it always did.
func TestCopiesReadsOlderGrants(t *testing.T) {
	f := newCopiesFleet(t)
	kv, err := f.b.KV(t.Context(), fleet.CopiesBucketConfig())
	if err != nil {
		t.Fatal(err)
	}
	until := time.Unix(0, f.clock.Load()).Add(10 * time.Minute).Format(time.RFC3339Nano)
	if _, err := kv.Put(t.Context(), events.InventoryImageToken(copiesImg), []byte(`{"grants":{"n1":"`+until+`"}}`)); err != nil {
		t.Fatal(err)
	}
	if f.remove("n2") {
		t.Error("within the older grant's time: n2 allowed")
	}
	f.advance(10*time.Minute + time.Second)
	if !f.remove("n2") {
		t.Error("past the older grant's time: n2 refused")
	}
}
