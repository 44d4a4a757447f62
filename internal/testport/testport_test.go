package testport

import (
	"net"
	"strconv"
	"testing"
)

func TestFreeIsBindableUniqueAndBelowTheEphemeralRange(t *testing.T) {
	seen := map[int]bool{}
	for range 50 {
		p := Free(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
		if p < lowest || p >= ephemeralLow() {
			t.Fatalf("port %d outside %d-%d", p, lowest, ephemeralLow()-1)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d not bindable: %v", p, err)
		}
		l.Close()
	}
}
