package fleet_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

func imageEvent(t testing.TB, node, action string, data any) events.Event {
	t.Helper()
	ev, err := events.New(node, events.EntityImage, action, data)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func detected(t testing.TB, node, id, tag string, size int64) events.Event {
	return imageEvent(t, node, events.ActionDetected, events.ImageRecord{ID: id, RepoTags: []string{tag}, Size: size,
		FirstDetected: time.Now().UTC(), LastUsed: time.Now().UTC()})
}

func runInventory(t *testing.T, b *bus.Bus, replica string) (*fleet.Inventory, func()) {
	t.Helper()
	inv, err := fleet.NewInventory(t.Context(), fleet.InventoryConfig{Replica: replica}, b)
	if err != nil {
		t.Fatal(err)
	}
	return inv, bustest.RunService(t, inv)
}

func query(t *testing.T, b *bus.Bus, q events.InventoryQuery) events.InventoryReply {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	var rep events.InventoryReply
	if err := b.Request(ctx, events.InventoryQuerySubject, q, &rep); err != nil {
		t.Fatalf("query %+v: %v", q, err)
	}
	return rep
}

func TestInventoryAggregatesImageEvents(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	evs := []events.Event{
		detected(t, "n1", "sha256:aaaaaaaa11", "docker.io/library/nginx:1.27", 100),
		detected(t, "n2", "sha256:aaaaaaaa11", "docker.io/library/nginx:1.27", 100),
		detected(t, "n3.example", "sha256:aaaaaaaa11", "docker.io/library/nginx:1.27", 100),
		detected(t, "n1", "sha256:bbbbbbbb22", "docker.io/library/redis:7", 50),
		detected(t, "n2", "sha256:cccccccc33", "registry.local:5000/app:v2", 300),
		imageEvent(t, "n3.example", events.ActionVanished, events.ImageRecord{ID: "sha256:aaaaaaaa11"}),
		imageEvent(t, "n2", events.ActionRemoved, events.ImageRemoved{ID: "sha256:cccccccc33", Size: 300, Reason: "space"}),
		// Not image events of interest: ignored, not dead letters.
		imageEvent(t, "n1", "relabelled", map[string]string{"id": "x"}),
	}
	if err := b.PublishAll(ctx, evs); err != nil {
		t.Fatal(err)
	}
	inv, stop := runInventory(t, b, "r1")
	defer stop()
	// Events are applied 32 at a time, so an image's detected event can come after its vanished or removed
	// one: it is then counted a duplicate (the bucket holds a later sequence), not applied. Each of the 7
	// image events is one or the other; the state below is the same either way. (When this waited for
	// Applied == 7, a CI run under -race timed out on it once; this reordering is the likely cause, inferred:
	// the stats were not printed then.)
	var st fleet.InventoryStats
	bustest.WaitFor(t, "events applied", func() bool {
		st = inv.Stats()
		return st.Applied+st.Duplicates >= 7 && st.Ignored >= 1
	})
	if st.Applied+st.Duplicates != 7 || st.Ignored != 1 || st.Applied < 5 {
		t.Fatalf("stats %+v: want the 7 image events applied or superseded once each (at least the 5 detected "+
			"ones of distinct keys applied) and 1 ignored", st)
	}
	var images events.InventoryReply
	bustest.WaitFor(t, "index caught up", func() bool {
		images = query(t, b, events.InventoryQuery{What: events.InventoryImages})
		return images.Total == 2 && len(images.Images) == 2 && images.Images[0].Nodes == 2
	})
	if im := images.Images[0]; im.ID != "sha256:aaaaaaaa11" || im.TotalBytes != 200 || im.Size != 100 {
		t.Errorf("first image: %+v", im)
	}
	if images.TotalBytes != 250 || images.Replica != "r1" {
		t.Errorf("images total %d replica %q", images.TotalBytes, images.Replica)
	}
	cases := []struct {
		name, image string
		wantNodes   []string
	}{
		{"by id", "sha256:aaaaaaaa11", []string{"n1", "n2"}},
		{"by id prefix without algorithm", "aaaaaaaa", []string{"n1", "n2"}},
		{"by short name", "nginx:1.27", []string{"n1", "n2"}},
		{"by full tag", "docker.io/library/redis:7", []string{"n1"}},
		{"removed image", "registry.local:5000/app:v2", nil},
		{"unknown", "busybox", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rep := query(t, b, events.InventoryQuery{What: events.InventoryWhere, Image: tc.image})
			var got []string
			for _, p := range rep.Placements {
				got = append(got, p.Node)
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.wantNodes) {
				t.Fatalf("where %s = %v, want %v", tc.image, got, tc.wantNodes)
			}
		})
	}
	nodes := query(t, b, events.InventoryQuery{What: events.InventoryNodes})
	if fmt.Sprintf("%+v", nodes.Nodes) != "[{Node:n1 Images:2 TotalBytes:150} {Node:n2 Images:1 TotalBytes:100}]" {
		t.Errorf("nodes: %+v", nodes.Nodes)
	}
	// Bad queries are answered with a clear error, and the replica keeps serving.
	for _, body := range []string{`{"what":"all"}`, `{"what":"where"}`, `{"what":"images","limit":-1}`, `{`, `{"what":"images","x":1}`} {
		rep, err := b.RequestRaw(ctx, events.InventoryQuerySubject, []byte(body))
		if err != nil || rep.Error == "" {
			t.Errorf("query %s: %v %+v", body, err, rep)
		}
	}
	if rep := query(t, b, events.InventoryQuery{What: events.InventoryImages, Limit: 1}); len(rep.Images) != 1 || rep.Total != 2 {
		t.Errorf("limit 1: %+v", rep)
	}
}

func TestInventoryApplyIsIdempotentAndOrdered(t *testing.T) {
	_, b := bustest.Start(t)
	inv, err := fleet.NewInventory(t.Context(), fleet.InventoryConfig{Replica: "r"}, b)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	msg := func(seq uint64, ev events.Event) *bus.Msg {
		m, err := bus.EventMsg(ev)
		if err != nil {
			t.Fatal(err)
		}
		return &bus.Msg{Subject: m.Subject, Data: m.Data, StreamSeq: seq}
	}
	det := detected(t, "n1", "sha256:dd", "x:1", 10)
	gone := imageEvent(t, "n1", events.ActionRemoved, events.ImageRemoved{ID: "sha256:dd"})
	steps := []struct {
		name                 string
		m                    *bus.Msg
		wantApplied, wantDup int64
		wantPermanent        bool
	}{
		{"detected", msg(10, det), 1, 0, false},
		{"redelivered", msg(10, det), 1, 1, false},
		{"removed later", msg(12, gone), 2, 1, false},
		{"older detected arriving late does not resurrect", msg(11, det), 2, 2, false},
		{"malformed", &bus.Msg{Subject: "imagefleet.evt.n1.image.detected", Data: []byte("{"), StreamSeq: 13}, 2, 2, true},
		{"detected without id", msg(14, imageEvent(t, "n1", events.ActionDetected, events.ImageRecord{})), 2, 2, true},
	}
	for _, st := range steps {
		err := inv.Apply(ctx, st.m)
		if bus.IsPermanent(err) != st.wantPermanent || (!st.wantPermanent && err != nil) {
			t.Fatalf("%s: err = %v", st.name, err)
		}
		if s := inv.Stats(); s.Applied != st.wantApplied || s.Duplicates != st.wantDup {
			t.Fatalf("%s: stats %+v", st.name, s)
		}
	}
}

func TestInventoryReplicasApplyEachEventOnce(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	r1, stop1 := runInventory(t, b, "r1")
	r2, stop2 := runInventory(t, b, "r2")
	const nodes, images = 20, 15
	var evs []events.Event
	for n := range nodes {
		for i := range images {
			evs = append(evs, detected(t, fmt.Sprintf("n%02d", n), fmt.Sprintf("sha256:%064x", i), fmt.Sprintf("img/%d:1", i), int64(1000+i)))
		}
	}
	if err := b.PublishAll(ctx, evs); err != nil {
		t.Fatal(err)
	}
	total := int64(len(evs))
	bustest.WaitFor(t, "every event applied", func() bool {
		return r1.Stats().Applied+r2.Stats().Applied+r1.Stats().Duplicates+r2.Stats().Duplicates >= total
	})
	s1, s2 := r1.Stats(), r2.Stats()
	if s1.Applied+s2.Applied != total {
		t.Fatalf("applied %d + %d, want %d in all (duplicates %d, %d)", s1.Applied, s2.Applied, total, s1.Duplicates, s2.Duplicates)
	}
	if s1.Applied == 0 || s2.Applied == 0 {
		t.Logf("one replica took every event (%d, %d): allowed, the server decides", s1.Applied, s2.Applied)
	}
	// Both replicas answer, and with the same figures.
	seen := map[string]bool{}
	bustest.WaitFor(t, "both replicas answer with the whole inventory", func() bool {
		rep := query(t, b, events.InventoryQuery{What: events.InventoryNodes})
		if rep.Total == nodes && rep.TotalBytes == int64(nodes)*int64(images*1000+images*(images-1)/2) {
			seen[rep.Replica] = true
		}
		return seen["r1"] && seen["r2"]
	})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); stop1() }()
	go func() { defer wg.Done(); stop2() }()
	wg.Wait()
}
