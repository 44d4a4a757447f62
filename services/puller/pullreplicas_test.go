package puller

import (
	"context"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestPullReplicasKeptByAgents: on a 3-server cluster an operator makes the pull partitions R1 (one Raft
// group less per node, docs/scale.md) while every other stream stays R3; an agent that ensures the streams
// with --stream-replicas 3 leaves the partitions R1, a node's pull consumer is made on one, and an explicit
// --pull-replicas 3 brings them back to R3.
func TestPullReplicasKeptByAgents(t *testing.T) {
	c := bustest.StartCluster(t, 3, bustest.ClusterName("pull"))
	b := connectCluster(t, c, "operator") // every stream R3
	ensure := func(cfg bus.StreamsConfig) {
		t.Helper()
		bustest.Eventually(t, "the streams", time.Minute, func() error {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			return b.EnsureStreams(ctx, cfg)
		})
	}
	replicas := func(stream string) int {
		t.Helper()
		info, err := b.Stream(t.Context(), stream)
		if err != nil {
			t.Fatal(err)
		}
		return info.Replicas
	}
	want := func(when string, pull, others int) {
		t.Helper()
		for p := range events.PullPartitions {
			if got := replicas(events.PullPartitionStream(p)); got != pull {
				t.Fatalf("%s: %s has %d replicas, want %d", when, events.PullPartitionStream(p), got, pull)
			}
		}
		for _, s := range []string{events.EventsStream, events.PodsStream, events.DeadLetterStream} {
			if got := replicas(s); got != others {
				t.Fatalf("%s: %s has %d replicas, want %d", when, s, got, others)
			}
		}
	}
	want("made R3", 3, 3)
	ensure(bus.StreamsConfig{Replicas: 3, PullReplicas: 1}) // bus init --stream-replicas 3 --pull-replicas 1
	want("after --pull-replicas 1", 1, 3)
	ensure(bus.StreamsConfig{Replicas: 3}) // an agent with --stream-replicas 3
	want("after an agent's --stream-replicas 3", 1, 3)

	node := "hollow-01150"
	cfg := Config{Node: node}
	cc := ConsumerConfig(cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := b.EnsureConsumer(ctx, cc); err != nil {
		t.Fatalf("node consumer on an R1 partition: %v", err)
	}

	ensure(bus.StreamsConfig{Replicas: 3, PullReplicas: 3})
	want("after --pull-replicas 3", 3, 3)
}
