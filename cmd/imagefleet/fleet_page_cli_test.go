package main_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestFleetNodesPages drives `imagefleet fleet nodes` over a registry written directly into the buckets:
// -l filters, --limit pages in name order with a continue token (in the JSON object and on stderr), and
// without paging flags the JSON output is the array it always was.
func TestFleetNodesPages(t *testing.T) {
	srv, b := bustest.Start(t)
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	seen, err := b.KVExisting(t.Context(), events.NodesSeenBucket)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b.KVExisting(t.Context(), events.NodesBucket)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	for i := range 7 {
		zone := []string{"a", "b"}[i%2]
		info := events.NodeInfo{Node: fmt.Sprintf("node-%d", i), Labels: map[string]string{"zone": zone}, Started: now,
			Heartbeat: now, Period: events.Duration{Duration: 10 * time.Second}}
		raw, _ := json.Marshal(info)
		if _, err := seen.Put(t.Context(), events.NodeToken(info.Node), raw); err != nil {
			t.Fatal(err)
		}
		if _, err := alive.Put(t.Context(), events.NodeToken(info.Node), raw); err != nil {
			t.Fatal(err)
		}
	}
	nats := []string{"--nats", srv.ClientURL()}
	var all []events.NodeStatus
	stdout, stderr, code := run(t, append([]string{"fleet", "nodes", "-o", "json"}, nats...)...)
	if code != 0 || json.Unmarshal([]byte(stdout), &all) != nil || len(all) != 7 {
		t.Fatalf("fleet nodes: exit %d, %d nodes\n%s\n%s", code, len(all), stdout, stderr)
	}
	var got []string
	cont := ""
	for pages := 0; ; pages++ {
		if pages > 4 {
			t.Fatal("paging does not end")
		}
		args := append([]string{"fleet", "nodes", "-l", "zone=a", "--limit", "3", "-o", "json"}, nats...)
		if cont != "" {
			args = append(args, "--continue", cont)
		}
		stdout, stderr, code = run(t, args...)
		var page struct {
			Nodes    []events.NodeStatus `json:"nodes"`
			Continue string              `json:"continue"`
			Total    int                 `json:"total"`
		}
		if code != 0 || json.Unmarshal([]byte(stdout), &page) != nil || page.Total != 7 {
			t.Fatalf("page %d: exit %d\n%s\n%s", pages, code, stdout, stderr)
		}
		for _, n := range page.Nodes {
			if n.State != events.NodeReady {
				t.Errorf("%s: %s", n.Node, n.State)
			}
			got = append(got, n.Node)
		}
		if page.Continue == "" {
			break
		}
		cont = page.Continue
	}
	if want := []string{"node-0", "node-2", "node-4", "node-6"}; !slices.Equal(got, want) {
		t.Fatalf("paged %v, want %v", got, want)
	}
	stdout, stderr, code = run(t, append([]string{"fleet", "nodes", "--limit", "2"}, nats...)...)
	if code != 0 || strings.Count(stdout, "\n") != 3 || !strings.Contains(stderr, "more follow: --continue node-1") {
		t.Fatalf("table page: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if _, stderr, code = run(t, append([]string{"fleet", "nodes", "-l", "zone=(a"}, nats...)...); code == 0 || !strings.Contains(stderr, "parse selector") {
		t.Fatalf("bad selector: exit %d\n%s", code, stderr)
	}
}

// TestFleetWhereAndImagesPages drives `imagefleet fleet where|images --limit --continue` against a real
// inventory replica, and against two partitioned replicas whose answers are gathered from their parts: the
// JSON answer carries the continue token, the table prints it on stderr.
func TestFleetWhereAndImagesPages(t *testing.T) {
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) { testFleetWhereAndImagesPages(t, partitioned) })
	}
}

func testFleetWhereAndImagesPages(t *testing.T, partitioned bool) {
	srv, b := bustest.Start(t)
	var evs []events.Event
	for n := range 5 {
		for i := range 3 {
			ev, err := events.New(fmt.Sprintf("node-%d", n), events.EntityImage, events.ActionDetected, events.ImageRecord{
				ID: fmt.Sprintf("sha256:%064x", i), RepoTags: []string{fmt.Sprintf("docker.io/library/app%d:1", i)}, Size: int64(10 * (i + 1)),
				FirstDetected: time.Now().UTC(), LastUsed: time.Now().UTC()})
			if err != nil {
				t.Fatal(err)
			}
			evs = append(evs, ev)
		}
	}
	// One image on 1,001 nodes: more than one chunk of the unpaged where.
	for n := range 1001 {
		ev, err := events.New(fmt.Sprintf("big-%04d", n), events.EntityImage, events.ActionDetected, events.ImageRecord{
			ID: fmt.Sprintf("sha256:%064x", 99), RepoTags: []string{"docker.io/library/big:1"}, Size: 1,
			FirstDetected: time.Now().UTC(), LastUsed: time.Now().UTC()})
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
	}
	for i := 0; i < len(evs); i += 500 {
		if err := b.PublishAll(t.Context(), evs[i:min(i+500, len(evs))]); err != nil {
			t.Fatal(err)
		}
	}
	var invs []*fleet.Inventory
	replicas := []string{"r1"}
	if partitioned {
		replicas = append(replicas, "r2")
	}
	for _, name := range replicas {
		inv, err := fleet.NewInventory(t.Context(), fleet.InventoryConfig{Replica: name, Partitioned: partitioned}, b)
		if err != nil {
			t.Fatal(err)
		}
		stop := bustest.RunService(t, inv)
		defer stop()
		invs = append(invs, inv)
	}
	bustest.WaitWithin(t, "inventory applied", time.Minute, func() bool {
		var applied int64
		owned := 0
		for _, inv := range invs {
			select {
			case <-inv.Ready():
			default:
				return false
			}
			st := inv.Stats()
			applied += st.Applied + st.Duplicates // a partition handed over may have some applied twice
			owned += len(inv.Owned())
		}
		return applied >= int64(len(evs)) && (!partitioned || owned == events.InventoryPartitions)
	})
	nats := []string{"--nats", srv.ClientURL()}
	var got []string
	cont := ""
	for pages := 0; ; pages++ {
		if pages > 5 {
			t.Fatal("paging does not end")
		}
		args := append([]string{"fleet", "where", "app1:1", "--limit", "2", "-o", "json"}, nats...)
		if cont != "" {
			args = append(args, "--continue", cont)
		}
		stdout, stderr, code := run(t, args...)
		var rep events.InventoryReply
		if code != 0 || json.Unmarshal([]byte(stdout), &rep) != nil || rep.Total != 5 {
			t.Fatalf("where page %d: exit %d\n%s\n%s", pages, code, stdout, stderr)
		}
		for _, p := range rep.Placements {
			got = append(got, p.Node)
		}
		if rep.Continue == "" {
			break
		}
		cont = rep.Continue
	}
	if want := []string{"node-0", "node-1", "node-2", "node-3", "node-4"}; !slices.Equal(got, want) {
		t.Fatalf("where pages %v, want %v", got, want)
	}
	// Without --limit, every page, fetched in chunks.
	stdout, stderr, code := run(t, append([]string{"fleet", "where", "big:1", "-o", "json"}, nats...)...)
	var whole events.InventoryReply
	if code != 0 || json.Unmarshal([]byte(stdout), &whole) != nil || whole.Total != 1001 || len(whole.Placements) != 1001 ||
		whole.Continue != "" || whole.Placements[1000].Node != "big-1000" {
		t.Fatalf("where big: exit %d, %d of %d placements\n%s", code, len(whole.Placements), whole.Total, stderr)
	}
	stdout, stderr, code = run(t, append([]string{"fleet", "where", "big:1", "--limit", "2"}, nats...)...)
	if code != 0 || !strings.HasPrefix(stdout, "NODE ") || !strings.Contains(stdout, "big-0000 ") || !strings.Contains(stdout, "1001 nodes") ||
		strings.Count(stdout, "\n") != 4 || !strings.Contains(stderr, "more follow: --continue ") {
		t.Fatalf("where table: exit %d\n%s\n%s", code, stdout, stderr)
	}
	stdout, stderr, code = run(t, append([]string{"fleet", "images", "--limit", "1"}, nats...)...)
	want := fmt.Sprintf("more follow: --continue 1001/sha256:%064x", 99)
	if code != 0 || !strings.Contains(stdout, "big:1") || strings.Contains(stdout, "app2:1") || !strings.Contains(stderr, want) {
		t.Fatalf("images page: exit %d\n%s\n%s", code, stdout, stderr)
	}
	stdout, stderr, code = run(t, append([]string{"fleet", "images", "--limit", "1", "--continue", fmt.Sprintf("1001/sha256:%064x", 99)}, nats...)...)
	if code != 0 || !strings.Contains(stdout, "app2:1") || strings.Contains(stdout, "big:1") {
		t.Fatalf("images next page: exit %d\n%s\n%s", code, stdout, stderr)
	}
}
