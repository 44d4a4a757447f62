package fleet

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestClaimStoredWithALostAckIsOurs: a run whose claim is stored but whose attempt was answered as if
// another run had claimed the node (its ack lost with a server, the retry refused by the subject check
// instead of being answered as a duplicate) finds its own claim first in the stream, and acts on the node
// once instead of counting it failed without acting. A claim of another run still keeps it off.
func TestClaimStoredWithALostAckIsOurs(t *testing.T) {
	_, b := bustest.Start(t)
	if err := EnsureRolloutStream(t.Context(), b, 1); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, id, claimOwner string
		wantActs             int
		wantOK               bool
	}{
		{"our own claim", "gc-claim-ours", "run-a", 1, true},
		{"another run's claim", "gc-claim-theirs", "run-b", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw, _ := json.Marshal(events.RolloutClaims{First: 0, Nodes: []string{"node-1"}, Owner: tc.claimOwner, Batch: 1, Time: time.Now().UTC()})
			// Stored under a message id the orchestrator's retry does not repeat: the server cannot answer it
			// as a duplicate.
			if _, err := b.PublishStored(t.Context(), bus.RawMsg{Subject: events.RolloutClaimsSubject(tc.id, 0),
				MsgID: tc.id + ".lost-ack", Data: raw}); err != nil {
				t.Fatal(err)
			}
			var acts atomic.Int64
			r, err := NewRollout(RolloutConfig{ID: tc.id, Kind: events.RolloutGC, Nodes: []string{"node-1"}}, b,
				func(context.Context, string) events.RolloutNodeResult {
					acts.Add(1)
					return events.RolloutNodeResult{OK: true}
				})
			if err != nil {
				t.Fatal(err)
			}
			r.owner = "run-a"
			res, err := r.Run(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if int(acts.Load()) != tc.wantActs || len(res.Nodes) != 1 || res.Nodes[0].OK != tc.wantOK {
				t.Fatalf("acted %d times, result %+v; want %d, ok %v", acts.Load(), res.Nodes, tc.wantActs, tc.wantOK)
			}
			if !tc.wantOK && !strings.Contains(res.Nodes[0].Error, "claimed by another run") {
				t.Errorf("error %q", res.Nodes[0].Error)
			}
		})
	}
}
