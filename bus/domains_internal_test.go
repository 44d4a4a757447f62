package bus

import "testing"

func TestWildcardsToRefs(t *testing.T) {
	for _, c := range []struct{ filter, want string }{
		{"imagefleet.cmd.*.pull.07", "imagefleet.cmd.{{wildcard(1)}}.pull.07"},
		{"imagefleet.cmd.*.pull", "imagefleet.cmd.{{wildcard(1)}}.pull"},
		{"a.*.b.*", "a.{{wildcard(1)}}.b.{{wildcard(2)}}"},
		{"a.b", "a.b"},
	} {
		if got := wildcardsToRefs(c.filter); got != c.want {
			t.Errorf("wildcardsToRefs(%q) = %q, want %q", c.filter, got, c.want)
		}
	}
}
