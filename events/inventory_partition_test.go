package events

import (
	"errors"
	"testing"
)

func TestSourceSequence(t *testing.T) {
	for _, tc := range []struct {
		name, header string
		want         uint64
		bad          bool
	}{
		{name: "plain", header: "IMAGEFLEET_EVENTS 42 imagefleet.evt.*.image.> imagefleet.inv.{{partition(16,1)}}.{{wildcard(1)}}.image.>", want: 42},
		{name: "across domains", header: "IMAGEFLEET_EVENTS:a1b2c3 7", want: 7},
		{name: "another stream", header: "IMAGEFLEET_PODS 42", bad: true},
		{name: "no sequence", header: "IMAGEFLEET_EVENTS", bad: true},
		{name: "zero", header: "IMAGEFLEET_EVENTS 0", bad: true},
		{name: "not a number", header: "IMAGEFLEET_EVENTS x1", bad: true},
		{name: "empty", header: "", bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SourceSequence(tc.header, EventsStream)
			if tc.bad {
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("SourceSequence(%q) = %d, %v; want ErrMalformed", tc.header, got, err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("SourceSequence(%q) = %d, %v; want %d", tc.header, got, err, tc.want)
			}
		})
	}
}

func TestInventoryPartitionNames(t *testing.T) {
	if got := InventoryPartitionDurable(3); got != "fleet-inventory-p03" {
		t.Errorf("durable %q", got)
	}
	if got := InventoryPartitionFilter(12); got != "imagefleet.inv.12.>" {
		t.Errorf("filter %q", got)
	}
	// The partition is the node token's: a dotted name and its token land together.
	if InventoryPartition("a.b") != InventoryPartition("a_b") {
		t.Error("a.b and its token a_b in different partitions")
	}
	p := InventoryPartition("node-1.zone")
	if got, want := InventoryCopySubject("node-1.zone", ActionDetected), "imagefleet.inv."+itoa(p)+".node-1_zone.image.detected"; got != want {
		t.Errorf("copy subject %q, want %q", got, want)
	}
	seen := map[int]bool{}
	for i := range 200 {
		seen[InventoryPartition("n"+itoa(i))] = true
	}
	if len(seen) != InventoryPartitions {
		t.Errorf("200 nodes in %d of %d partitions", len(seen), InventoryPartitions)
	}
	// A key's node token gives the same partition without the name.
	for _, node := range []string{"n1", "node-1.zone", "a_b", "", "hollow-09999", "x.y.z"} {
		if got, want := InventoryTokenPartition(NodeToken(node)), InventoryPartition(node); got != want {
			t.Errorf("%q: token partition %d, want %d", node, got, want)
		}
	}
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}
