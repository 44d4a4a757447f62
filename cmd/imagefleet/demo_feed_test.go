package main

import (
	"context"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestDemoFeedWaitsForThePullResults: the demo's feed is read again until it holds the pull results the demo
// waited for, as a subscriber can see an event before the stream has stored it (TestDemo once printed a
// feed without the last pull's warning). Here the awaited event reaches the stream 300 ms after the first
// read.
func TestDemoFeedWaitsForThePullResults(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	first, err := events.New("demo-feed", events.EntityPull, events.ActionPulled, events.PullResult{Image: "a:1", Pulled: true})
	if err != nil {
		t.Fatal(err)
	}
	late, err := events.New("demo-feed", events.EntityPull, events.ActionFailed, events.PullResult{Image: "b:1", Error: "ErrImageNeverPull"})
	if err != nil {
		t.Fatal(err)
	}
	late.Severity, late.Reason, late.Message = events.Warning, "ErrImageNeverPull", "not present with pull policy of Never"
	if err := b.PublishAll(ctx, []events.Event{first}); err != nil {
		t.Fatal(err)
	}
	published := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		published <- b.PublishAll(context.Background(), []events.Event{late})
	}()
	counts, warnings, err := demoFeed(ctx, b, "demo-feed", []string{first.ID, late.ID})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if counts[first.Type] != 1 || counts[late.Type] != 1 {
		t.Fatalf("feed counts %v, want one %s and one %s", counts, first.Type, late.Type)
	}
	if len(warnings) != 1 || warnings[0] != "ErrImageNeverPull: not present with pull policy of Never" {
		t.Fatalf("feed warnings %q, want the late pull's", warnings)
	}
}
