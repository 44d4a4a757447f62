package removals

import "testing"

// TestPositionFloor: the floor of the vanished events handled is the last one handled, held just before one
// handed back for redelivery until it is handled or given up on, and raised to the consumer's ack floor; it
// is not known before the ack floor was read or an event handled.
func TestPositionFloor(t *testing.T) {
	var p position
	check := func(want uint64, wantKnown bool) {
		t.Helper()
		if f, ok := p.floor(); f != want || ok != wantKnown {
			t.Fatalf("floor %d, known %v; want %d, %v", f, ok, want, wantKnown)
		}
	}
	check(0, false)
	p.acked(4)
	check(4, true)
	p.done(5, false)
	p.done(6, true) // handed back: delivered again after 7
	p.done(7, false)
	check(5, true)
	p.done(6, false)
	check(7, true)
	p.done(9, true)
	p.done(11, true)
	check(7, true)
	p.acked(10) // the server counts 9 acked
	check(10, true)
	p.done(11, false) // given up on: a dead letter
	check(11, true)
	p.acked(3) // an older ack floor lowers nothing
	check(11, true)
}
