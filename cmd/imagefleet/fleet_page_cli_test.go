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
