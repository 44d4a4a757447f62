// Package testport hands tests TCP ports on 127.0.0.1 that a server they start later can bind.
//
// A port from listening on :0 comes from the kernel's ephemeral range, the same range outgoing
// connections take their local ports from: between closing the probe listener and the server's bind, any
// connection of any test running alongside may take it, and the server fails with "address already in
// use" (CI saw a NATS cluster member never come up this way). These ports come from below the ephemeral
// range instead, picked at random, checked free, and never handed out twice by one process.
package testport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const lowest = 20000

var (
	mu    sync.Mutex
	given = map[int]bool{}
)

// Free returns a port of 127.0.0.1 that is free now, lies outside the ephemeral range, and was not returned
// before in this process.
func Free(t testing.TB) int {
	t.Helper()
	p, err := pick()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func pick() (int, error) {
	high := ephemeralLow() - 1
	mu.Lock()
	defer mu.Unlock()
	for range 1000 {
		p := lowest + rand.IntN(high-lowest+1)
		if given[p] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		l.Close()
		given[p] = true
		return p, nil
	}
	return 0, fmt.Errorf("testport: no free port in %d-%d after 1000 tries", lowest, high)
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux), 32768 where it cannot be read.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > lowest+1000 {
				return n
			}
		}
	}
	return 32768
}
