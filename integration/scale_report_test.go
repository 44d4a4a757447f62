package integration_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

// TestScaleReportHelpers: the benchmarks' summaries of a rollout read what they should: warnings written
// after the offset only, grouped by level and message with a node named; node times in order.
func TestScaleReportHelpers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "hollow.log")
	before := `time=2026-11-24T14:00:00Z level=WARN msg="before the rollout" node=hollow-00001` + "\n"
	during := `time=2026-11-24T14:00:01Z level=INFO msg="pulled" node=hollow-00002
time=2026-11-24T14:00:02Z level=WARN msg="consumer has no pull request waiting; pulling anew" node=hollow-00003 stream=IMAGEFLEET_PULL_01 idle=25s
time=2026-11-24T14:00:03Z level=WARN msg="consumer has no pull request waiting; pulling anew" node=hollow-00004 stream=IMAGEFLEET_PULL_02 idle=20s
time=2026-11-24T14:00:04Z level=ERROR msg=failed node=hollow-00005 err="a \"quoted\" reason"
hollow: 3 agents running
`
	if err := os.WriteFile(path, []byte(before+during), 0o644); err != nil {
		t.Fatal(err)
	}
	got := logWarnings(path, int64(len(before)))
	want := "  2 x WARN consumer has no pull request waiting; pulling anew (hollow-00003, ...)\n  1 x ERROR failed (hollow-00005, ...)\n"
	if got != want {
		t.Errorf("logWarnings:\n%s\nwant:\n%s", got, want)
	}
	if got := logField(`time=x level=ERROR msg=failed node=hollow-00005 err="a \"quoted\" reason"`, "err"); got != `a "quoted" reason` {
		t.Errorf("quoted field: %q", got)
	}
	if got := logWarnings(path, int64(len(before)+len(during))); got != "" {
		t.Errorf("nothing after the offset, got %q", got)
	}

	var nodes []events.RolloutNodeResult
	for i := range 1000 {
		nodes = append(nodes, events.RolloutNodeResult{Node: "n" + string(rune('a'+i%26)), Batch: 10,
			Duration: events.Duration{Duration: time.Duration(i+1) * time.Millisecond}})
	}
	nodes[0] = events.RolloutNodeResult{Node: "late", Batch: 3, Duration: events.Duration{Duration: 5 * time.Second}}
	s := nodeTimes(nodes)
	for _, part := range []string{"p50 502ms", "p99 992ms", "slowest late 5s (batch 3), "} {
		if !strings.Contains(s, part) {
			t.Errorf("nodeTimes %q lacks %q", s, part)
		}
	}
	if nodeTimes(nil) != "" {
		t.Error("nodeTimes of no nodes is not empty")
	}
}
