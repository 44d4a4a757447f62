package bus_test

import (
	"context"
	"slices"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestPullPartitionStreams: EnsureStreams makes the 16 pull partitions with the work-queue settings of the
// single queue and an explicit MaxConsumers, and keeps the legacy queue. A limit an operator raised on a
// partition stays; one lowered below 1,000 is brought back up.
func TestPullPartitionStreams(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx := t.Context()
	_, js := bustest.JetStream(t, srv)
	config := func(name string) jetstream.StreamConfig {
		t.Helper()
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return s.CachedInfo().Config
	}
	for p := range events.PullPartitions {
		c := config(events.PullPartitionStream(p))
		if !slices.Equal(c.Subjects, []string{events.PullPartitionSubjects(p)}) || c.Retention != jetstream.WorkQueuePolicy ||
			c.MaxMsgsPerSubject != events.MaxPullRequestsPerNode || c.Discard != jetstream.DiscardNew || !c.DiscardNewPerSubject ||
			c.MaxConsumers != events.PullPartitionMaxConsumers || c.Storage != jetstream.FileStorage {
			t.Errorf("%s: %+v", c.Name, c)
		}
	}
	if c := config(events.PullStream); !slices.Equal(c.Subjects, []string{events.PullSubjects}) || c.Retention != jetstream.WorkQueuePolicy {
		t.Errorf("legacy queue: %+v", c)
	}

	set := func(p, n int) {
		t.Helper()
		c := config(events.PullPartitionStream(p))
		c.MaxConsumers = n
		if _, err := js.UpdateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	set(0, 2000)
	set(1, 500)
	if err := b.EnsureStreams(context.Background(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	if got := config(events.PullPartitionStream(0)).MaxConsumers; got != 2000 {
		t.Errorf("raised limit after EnsureStreams: %d, want 2000 kept", got)
	}
	if got := config(events.PullPartitionStream(1)).MaxConsumers; got != events.PullPartitionMaxConsumers {
		t.Errorf("lowered limit after EnsureStreams: %d, want %d", got, events.PullPartitionMaxConsumers)
	}
}
