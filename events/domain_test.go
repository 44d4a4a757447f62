package events

import "testing"

func TestDomainSubject(t *testing.T) {
	for _, c := range []struct{ name, domain, subject, want string }{
		{"fleet's own domain", "", "imagefleet.cmd.node-1.pull.07", "imagefleet.cmd.node-1.pull.07"},
		{"a node's pull subject", "leaf-a", "imagefleet.cmd.node-1.pull.07", "imagefleet.domain.leaf-a.cmd.node-1.pull.07"},
		{"a stream's filter", "edge-1", "imagefleet.cmd.*.pull", "imagefleet.domain.edge-1.cmd.*.pull"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := DomainSubject(c.domain, c.subject); got != c.want {
				t.Errorf("DomainSubject(%q, %q) = %q, want %q", c.domain, c.subject, got, c.want)
			}
		})
	}
}

func TestValidateDomain(t *testing.T) {
	for _, c := range []struct {
		domain string
		ok     bool
	}{{"hub", true}, {"leaf-a", true}, {"edge_1", true}, {"", false}, {"a.b", false}, {"a*", false}, {"a>", false}, {"a b", false}} {
		if err := ValidateDomain(c.domain); (err == nil) != c.ok {
			t.Errorf("ValidateDomain(%q) = %v, want ok %v", c.domain, err, c.ok)
		}
	}
}
