package main

import (
	"bytes"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
)

// syncBuffer is a bytes.Buffer safe for one writer and one reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestHollowStartReportsItsProgress: while agents start, the hollow fleet prints how many were launched, are
// Ready and are starting, says so when agents are starting and none became Ready over a period, and stops
// once every agent was launched and none is starting.
func TestHollowStartReportsItsProgress(t *testing.T) {
	var out syncBuffer
	var launched atomic.Int64
	var starting atomic.Int64
	launched.Store(5)
	starting.Store(3)
	done := make(chan struct{})
	go func() {
		defer close(done)
		reportStart(t.Context(), &out, 8, &launched, func() int { return int(starting.Load()) }, 10*time.Millisecond)
	}()
	lines := func() []string { return strings.Split(strings.TrimSpace(out.String()), "\n") }
	bustest.WaitFor(t, "two reports", func() bool { return len(lines()) >= 2 })
	got := lines()
	if want := "hollow: 5 of 8 agents launched, 2 Ready or ended, 3 starting, after "; !strings.HasPrefix(got[0], want) || strings.Contains(got[0], "no agent") {
		t.Errorf("first report %q, want it to start %q and say nothing of a stall", got[0], want)
	}
	if !strings.Contains(got[1], "; no agent became Ready in the last 10ms") {
		t.Errorf("second report %q: the count of Ready agents did not move, and it does not say so", got[1])
	}
	starting.Store(1)
	// A report already under way may still count 3 starting; the first that counts 1 saw the Ready count move.
	moved := func() string {
		for _, l := range lines() {
			if strings.Contains(l, "4 Ready or ended, 1 starting") {
				return l
			}
		}
		return ""
	}
	bustest.WaitFor(t, "a report after two agents became Ready", func() bool { return moved() != "" })
	if l := moved(); strings.Contains(l, "no agent") {
		t.Errorf("the first report after two agents became Ready speaks of a stall: %q", l)
	}
	// Launched slowly: none starting and the Ready count unchanged is no stall.
	launched.Store(6)
	starting.Store(0)
	idle := func() int {
		n := 0
		for _, l := range lines() {
			if strings.Contains(l, "6 of 8 agents launched, 6 Ready or ended, 0 starting") {
				n++
			}
		}
		return n
	}
	bustest.WaitFor(t, "two reports with none starting", func() bool { return idle() >= 2 })
	// Every agent launched, none starting: the reports end.
	launched.Store(8)
	starting.Store(0)
	select {
	case <-done:
	case <-time.After(bustest.Timeout):
		t.Fatal("the reports went on after every agent was Ready")
	}
	for _, l := range lines() {
		if strings.Contains(l, " 0 starting") && strings.Contains(l, "no agent") {
			t.Errorf("a stall reported while no agent was starting: %q", l)
		}
	}
}
