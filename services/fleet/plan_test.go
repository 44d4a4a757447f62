package fleet_test

import (
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestPlanMatchesSelectingTheWholeRegistry: Plan, which reads the registry once with the selector applied
// as it streams, picks exactly what selectNodes picks over every node of the registry (same nodes, same
// order, lost nodes skipped with the same reason or planned with --include-lost), in a fleet mixing agents
// of this release (thin heartbeats), of the previous one (full records in both buckets), lost ones, and
// nodes on leaf domains; and it returns the planned nodes' domains.
func TestPlanMatchesSelectingTheWholeRegistry(t *testing.T) {
	_, b := bustest.Start(t)
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	var now atomic.Int64
	now.Store(start.UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()).UTC() }
	if err := fleet.EnsureBuckets(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	statfs := func(string) (int64, int64, error) { return 100 << 30, 60 << 30, nil }
	var hbs []*fleet.Heartbeat
	for _, i := range []int{5, 1, 8, 3} { // this release's agents, out of name order
		hb, err := fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: fmt.Sprintf("new-%d", i),
			Labels: map[string]string{"zone": []string{"a", "b"}[i%2], "tier": "web"}, Period: 10 * time.Second,
			Statfs: statfs, Clock: clock, AgentVersion: "v2"}, critest.NewRuntime(), b)
		if err != nil {
			t.Fatal(err)
		}
		hbs = append(hbs, hb)
	}
	old := func(node, zone, domain string) events.NodeInfo {
		return events.NodeInfo{Node: node, Labels: map[string]string{"zone": zone}, AgentVersion: "v1", Started: start,
			Heartbeat: clock(), Period: events.Duration{Duration: 10 * time.Second}, JSDomain: domain}
	}
	// Three periods with everyone; then new-3 and old-lost stop and four more periods pass.
	for period := range 7 {
		now.Add(int64(10 * time.Second))
		for _, hb := range hbs {
			if period >= 3 && hb == hbs[3] {
				continue
			}
			if _, err := hb.Beat(t.Context()); err != nil {
				t.Fatal(err)
			}
		}
		previousReleaseBeat(t, b, old("old-2", "a", "leaf-east"))
		previousReleaseBeat(t, b, old("old-0", "b", ""))
		previousReleaseBeat(t, b, old("old-9", "a", "leaf-west"))
		if period < 3 {
			previousReleaseBeat(t, b, old("old-lost", "a", "leaf-east"))
		}
	}
	reg, err := fleet.OpenRegistry(t.Context(), b, fleet.RegistryOptions{Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	all, err := reg.Nodes(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 8 {
		t.Fatalf("registry holds %d nodes, want 8: %+v", len(all), all)
	}
	cases := []struct {
		selector    string
		includeLost bool
		wantNodes   []string
		wantSkipped []string
		wantDomains map[string]string
	}{
		{"", false, []string{"new-1", "new-5", "new-8", "old-0", "old-2", "old-9"}, []string{"new-3", "old-lost"},
			map[string]string{"old-2": "leaf-east", "old-9": "leaf-west", "old-lost": "leaf-east"}},
		{"zone=a", false, []string{"new-8", "old-2", "old-9"}, []string{"old-lost"},
			map[string]string{"old-2": "leaf-east", "old-9": "leaf-west", "old-lost": "leaf-east"}},
		{"zone=a", true, []string{"new-8", "old-2", "old-9", "old-lost"}, nil,
			map[string]string{"old-2": "leaf-east", "old-9": "leaf-west", "old-lost": "leaf-east"}},
		{"zone=b,tier=web", false, []string{"new-1", "new-5"}, []string{"new-3"}, map[string]string{}},
		{"zone in (b),!tier", false, []string{"old-0"}, nil, map[string]string{}},
		{"zone=c", true, nil, nil, map[string]string{}},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("selector=%q/include-lost=%v", tc.selector, tc.includeLost), func(t *testing.T) {
			p, err := fleet.Plan(t.Context(), b, tc.selector, tc.includeLost, clock)
			if err != nil {
				t.Fatal(err)
			}
			sel, _ := fleet.ParseSelector(tc.selector)
			wantNodes, wantSkipped := fleet.SelectNodes(all, sel, tc.includeLost)
			if !slices.Equal(p.Nodes, wantNodes) || !slices.Equal(p.Skipped, wantSkipped) {
				t.Fatalf("plan %v skipped %v; selecting the whole registry: %v skipped %v", p.Nodes, p.Skipped, wantNodes, wantSkipped)
			}
			if !slices.Equal(p.Nodes, tc.wantNodes) {
				t.Fatalf("planned %v, want %v", p.Nodes, tc.wantNodes)
			}
			var skipped []string
			for _, s := range p.Skipped {
				skipped = append(skipped, s.Node)
				if s.Error != "node is Lost (last heartbeat 40s ago)" {
					t.Errorf("skipped %s: %q", s.Node, s.Error)
				}
			}
			if !slices.Equal(skipped, tc.wantSkipped) {
				t.Fatalf("skipped %v, want %v", skipped, tc.wantSkipped)
			}
			if !maps.Equal(p.Domains, tc.wantDomains) {
				t.Fatalf("domains %v, want %v", p.Domains, tc.wantDomains)
			}
		})
	}
	if _, err := fleet.Plan(t.Context(), b, "zone in (", false, clock); err == nil {
		t.Fatal("a bad selector was accepted")
	}
}
