package detector_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
)

// TestDetectWithRecordsListsWhatTheStoreHolds: a detect command with WithRecords is answered with the
// node's records after the detection, sorted by ID and equal to the bucket's; one without gets no list; a
// node whose records do not fit in events.MaxDetectReplyListBytes gets no list either (Listed false).
func TestDetectWithRecordsListsWhatTheStoreHolds(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	set(rt, []cri.Image{{ID: "sha256:b", Size: 2, RepoTags: []string{"b:1"}}, {ID: "sha256:a", Size: 1}},
		[]cri.Container{{ID: "c", ImageID: "sha256:b"}}, nil)
	defer start(t, b, rt, time.Now)()

	if rep := detect(t, b, time.Now()); rep.Listed || rep.List != nil {
		t.Fatalf("detect without WithRecords: listed %v, list %+v; want none", rep.Listed, rep.List)
	}
	ask := func() events.DetectReply {
		t.Helper()
		var rep events.DetectReply
		at := time.Now()
		if err := b.Request(t.Context(), events.CommandSubject(node, events.VerbDetect), events.DetectRequest{Time: &at, WithRecords: true}, &rep); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	rep := ask()
	stored := load(t, b)
	if !rep.Listed || len(rep.List) != 2 || len(stored) != 2 || rep.Records != 2 {
		t.Fatalf("listed %v, list %+v, records %d, stored %d; want 2 listed", rep.Listed, rep.List, rep.Records, len(stored))
	}
	if rep.List[0].ID != "sha256:a" || rep.List[1].ID != "sha256:b" {
		t.Errorf("list order %s, %s; want by ID", rep.List[0].ID, rep.List[1].ID)
	}
	for _, r := range rep.List {
		s := stored[r.ID]
		if !r.FirstDetected.Equal(s.FirstDetected) || !r.LastUsed.Equal(s.LastUsed) || r.InUse != s.InUse || !slices.Equal(r.RepoTags, s.RepoTags) {
			t.Errorf("%s listed %+v, stored %+v", r.ID, r, s)
		}
	}

	// 2,000 records with 300-byte tags: about 700 KiB of JSON, over the limit.
	var many []cri.Image
	for i := range 2000 {
		many = append(many, cri.Image{ID: fmt.Sprintf("sha256:%064d", i), Size: 1, RepoTags: []string{strings.Repeat("r", 290) + fmt.Sprintf(":%d", i)}})
	}
	set(rt, many, nil, nil)
	if rep := ask(); rep.Listed || rep.List != nil || rep.Records != 2000 {
		t.Errorf("2,000 large records: listed %v, %d in the list, records %d; want no list and 2000", rep.Listed, len(rep.List), rep.Records)
	}
}
