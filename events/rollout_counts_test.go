package events

import (
	"encoding/json"
	"testing"
)

// TestRolloutNodeResultCounts: a real GC's compact record and an older record with the image lists give
// the same counts; a dry run's record keeps its lists; the compact record round-trips through JSON.
func TestRolloutNodeResultCounts(t *testing.T) {
	full := RolloutNodeResult{Node: "node-1", OK: true, GC: &GCResult{Node: "node-1", FreedBytes: 30,
		Removed: []GCRemoved{{ID: "a", Size: 10}, {ID: "b", Size: 20}, {ID: "c", Size: 5, Error: "in use"}},
		Failed:  []GCRemoved{{ID: "c", Size: 5, Error: "in use"}},
		Skipped: []GCSkipped{{ID: "p", Why: "pinned"}}}}
	want := GCCounts{Removed: 2, Failed: 1, Skipped: 1, Bytes: 30}
	if got := full.Counts(); got != want {
		t.Errorf("counts of the full record: %+v, want %+v", got, want)
	}
	compact := full.Compact()
	if compact.GC.Removed != nil || compact.GC.Skipped != nil || compact.GC.Failed != nil || compact.GC.FreedBytes != 30 {
		t.Errorf("compact GC %+v still has its lists", compact.GC)
	}
	if len(full.GC.Removed) != 3 {
		t.Errorf("Compact changed the original's lists")
	}
	raw, err := json.Marshal(compact)
	if err != nil {
		t.Fatal(err)
	}
	var back RolloutNodeResult
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if got := back.Counts(); got != want {
		t.Errorf("counts of the compact record read back: %+v, want %+v (%s)", got, want, raw)
	}
	dry := full
	dry.GC = &GCResult{DryRun: true, Removed: full.GC.Removed}
	if c := dry.Compact(); len(c.GC.Removed) != 3 || c.GCCounts != nil {
		t.Errorf("a dry run's record lost its list: %+v", c)
	}
	if (RolloutNodeResult{Node: "n", Pull: &PullOutcome{ImageRef: "sha256:x"}}).Compact().GCCounts != nil {
		t.Errorf("a pull outcome got GC counts")
	}
}
