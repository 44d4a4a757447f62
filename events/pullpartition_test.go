package events

import (
	"strconv"
	"strings"
	"testing"
)

// TestPullPartition: the partition is FNV-1a (32 bits) of the node name, mod 16, the same function for every
// publisher and puller; the subject keeps the node token third (the per-node permissions) and lands in the
// partition's stream filter.
func TestPullPartition(t *testing.T) {
	// FNV-1a 32 test vectors (Fowler/Noll/Vo): "a" = 0xe40c292c, "foobar" = 0xbf9cf968.
	for name, want := range map[string]int{"a": 0xe40c292c % 16, "foobar": 0xbf9cf968 % 16} {
		if got := PullPartition(name); got != want {
			t.Errorf("PullPartition(%q) = %d, want %d", name, got, want)
		}
	}
	counts := make([]int, PullPartitions)
	for i := range 10000 {
		node := "hollow-" + strconv.Itoa(i)
		p := PullPartition(node)
		counts[p]++
		subj := PullSubject(node)
		if !strings.HasPrefix(subj, CommandSubject(node, VerbPull)+".") {
			t.Fatalf("PullSubject(%q) = %q: not under the node's command subject", node, subj)
		}
		if !matchSubject(PullPartitionSubjects(p), subj) || matchSubject(PullSubjects, subj) {
			t.Fatalf("PullSubject(%q) = %q: not (only) in partition %d's filter %q", node, subj, p, PullPartitionSubjects(p))
		}
		if PullStreamOf(node) != PullPartitionStream(p) {
			t.Fatalf("PullStreamOf(%q) = %q, want %q", node, PullStreamOf(node), PullPartitionStream(p))
		}
	}
	// 10,000 nodes over 16 partitions: 625 each on average; a hash this even keeps every partition far
	// below PullPartitionMaxConsumers.
	for p, n := range counts {
		if n < 500 || n > 750 {
			t.Errorf("partition %d holds %d of 10,000 hollow nodes, want 500-750 (%v)", p, n, counts)
		}
	}
	for p := range PullPartitions {
		for q := range PullPartitions {
			if p != q && matchSubject(PullPartitionSubjects(p), strings.ReplaceAll(PullPartitionSubjects(q), "*", "n")) {
				t.Errorf("partition filters %d and %d overlap", p, q)
			}
		}
	}
}

// matchSubject reports whether subject matches filter, a NATS filter with '*' tokens (no '>').
func matchSubject(filter, subject string) bool {
	f, s := strings.Split(filter, "."), strings.Split(subject, ".")
	if len(f) != len(s) {
		return false
	}
	for i := range f {
		if f[i] != "*" && f[i] != s[i] {
			return false
		}
	}
	return true
}
