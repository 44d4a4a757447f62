package bus_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

func registeredEvent(t *testing.T, node string, i int) events.Event {
	t.Helper()
	ev, err := events.New(node, events.EntitySecret, events.ActionRegistered,
		events.RefChange{Kind: events.KindSecret, Namespace: "ns", Name: fmt.Sprintf("s-%d", i), Count: 1, PodUID: "u", PodName: "p"})
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func publishedSecretRegistered(t *testing.T) float64 {
	t.Helper()
	v, ok := series(t, "imagefleet_bus_events_published_total", map[string]string{"entity": events.EntitySecret, "action": events.ActionRegistered})
	if !ok {
		t.Fatal("imagefleet_bus_events_published_total{entity=secret,action=registered} is not exported")
	}
	return v
}

// TestAsyncPublishIsStoredAndCounted: secret.registered, published with Async as the pod index does, is
// stored and counted once its acks are awaited (it was neither counted nor journaled before Async joined
// the one publish path).
func TestAsyncPublishIsStoredAndCounted(t *testing.T) {
	_, b := bustest.Start(t)
	const node = "async-node"
	before := publishedSecretRegistered(t)
	evs := []events.Event{registeredEvent(t, node, 0), registeredEvent(t, node, 1), registeredEvent(t, node, 2)}
	var p bus.Pending
	if err := b.PublishAll(t.Context(), evs, bus.Async(&p)); err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := publishedSecretRegistered(t) - before; got != 3 {
		t.Errorf("counted %v secret.registered events, want 3", got)
	}
	waitStored(t, b, node, []string{evs[0].ID, evs[1].ID, evs[2].ID})
	// Waiting again counts nothing twice.
	if err := p.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := publishedSecretRegistered(t) - before; got != 3 {
		t.Errorf("after a second Wait: counted %v, want 3", got)
	}
}

// TestAsyncPublishIsJournaled: with a journal, an Async publish is journaled (and so survives an outage),
// then sent and counted by the journal's sender.
func TestAsyncPublishIsJournaled(t *testing.T) {
	r := startRestartable(t)
	b := connectJournaled(t, r, bus.JournalConfig{Dir: t.TempDir()})
	const node = "async-journal-node"
	before := publishedSecretRegistered(t)
	evs := []events.Event{registeredEvent(t, node, 0), registeredEvent(t, node, 1)}
	var p bus.Pending
	if err := b.PublishAll(t.Context(), evs, bus.Async(&p)); err != nil {
		t.Fatal(err)
	}
	if st := b.JournalStats(); st.Appended != 2 {
		t.Fatalf("journal stats %+v, want 2 appended", st)
	}
	if err := p.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	waitStored(t, b, node, []string{evs[0].ID, evs[1].ID})
	bustest.Eventually(t, "2 secret.registered events counted", 10*time.Second, func() error {
		if n := publishedSecretRegistered(t) - before; n != 2 {
			return fmt.Errorf("counted %v secret.registered events, want 2", n)
		}
		return nil
	})
}
