package puller

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

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
	ensureStreams(t, b, bus.StreamsConfig{Replicas: 3, PullReplicas: 1}, time.Minute) // bus init --stream-replicas 3 --pull-replicas 1
	want("after --pull-replicas 1", 1, 3)
	ensureStreams(t, b, bus.StreamsConfig{Replicas: 3}, time.Minute) // an agent with --stream-replicas 3
	want("after an agent's --stream-replicas 3", 1, 3)

	node := "hollow-01150"
	cfg := Config{Node: node}
	cc := ConsumerConfig(cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := b.EnsureConsumer(ctx, cc); err != nil {
		t.Fatalf("node consumer on an R1 partition: %v", err)
	}

	ensureStreams(t, b, bus.StreamsConfig{Replicas: 3, PullReplicas: 3}, time.Minute)
	want("after --pull-replicas 3", 3, 3)
}

// TestNodeConsumerStorageFollowsPartitionReplicas: on a 3-server cluster a node's pull consumer on an R3
// partition keeps its state in memory (replicated on the three servers), and on an R1 partition in files; a
// consumer already made with the other storage (by an earlier release, which made every node's consumer with
// files, or before the partition's replicas changed) is kept as it is, and the puller runs on it.
func TestNodeConsumerStorageFollowsPartitionReplicas(t *testing.T) {
	c := bustest.StartCluster(t, 3, bustest.ClusterName("storage"))
	b := connectCluster(t, c, "operator") // every stream R3
	// Each on a connection of its own, as an agent starting: a Bus remembers the storage it made a consumer
	// with.
	ensureConsumer := func(cc bus.ConsumerConfig) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		if err := c.Connect("agent").EnsureConsumer(ctx, cc); err != nil {
			t.Fatalf("consumer %s: %v", cc.Durable, err)
		}
	}
	memory := func(node string) bool {
		t.Helper()
		st, err := b.Consumer(t.Context(), events.PullStreamOf(node), events.PullerDurable(node))
		if err != nil {
			t.Fatal(err)
		}
		return st.MemoryStorage
	}

	onR3, earlier, onR1 := "node-r3", testNode, "node-r1"
	ensureConsumer(ConsumerConfig(Config{Node: onR3}))
	if !memory(onR3) {
		t.Errorf("%s: the consumer on an R3 partition keeps its state in files, want memory", onR3)
	}
	// An earlier release's consumer: files on an R3 partition.
	old := ConsumerConfig(Config{Node: earlier})
	old.MemoryStorageWhenReplicated = false
	ensureConsumer(old)
	ensureConsumer(ConsumerConfig(Config{Node: earlier}))
	if memory(earlier) {
		t.Errorf("%s: an earlier release's file consumer was not kept", earlier)
	}

	ensureStreams(t, b, bus.StreamsConfig{Replicas: 3, PullReplicas: 1}, time.Minute) // bus init --stream-replicas 3 --pull-replicas 1
	ensureConsumer(ConsumerConfig(Config{Node: onR1}))
	if memory(onR1) {
		t.Errorf("%s: the consumer on an R1 partition keeps its state in memory, want files", onR1)
	}
	// Made in memory on R3, its partition now R1: kept.
	ensureConsumer(ConsumerConfig(Config{Node: onR3}))
	if !memory(onR3) {
		t.Errorf("%s: the memory consumer was not kept after its partition became R1", onR3)
	}

	// The puller runs on a kept consumer: a pull request reaches it.
	ensureStreams(t, b, bus.StreamsConfig{Replicas: 3, PullReplicas: 3}, time.Minute)
	// The partition's R3 group is a new Raft group, which elects its leader after the update returns: a
	// request published before that times out.
	bustest.Eventually(t, "the node's partition led as R3", time.Minute, func() error {
		st, err := b.Stream(t.Context(), events.PullStreamOf(earlier))
		if err != nil {
			return err
		}
		if st.Replicas != 3 || st.Leader == "" {
			return fmt.Errorf("replicas %d, leader %q", st.Replicas, st.Leader)
		}
		return nil
	})
	cb := c.Connect("agent")
	startService(t, cb, newFakeImages(), Config{Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, cb)
	id := events.NewID()
	if _, err := Enqueue(t.Context(), b, earlier, events.PullRequest{ID: id, Image: "registry.example/app:1", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	for {
		ev, res, err := nextPullEvent(t, ctx, sub)
		if err != nil {
			t.Fatalf("no result from the puller on the kept consumer: %v", err)
		}
		if res.RequestID == id && ev.Type == events.TypeName(events.EntityPull, events.ActionPulled) {
			break
		}
	}
	if memory(earlier) {
		t.Errorf("%s: the puller changed the kept consumer's storage", earlier)
	}
}

// TestMemoryNodeConsumerAfterEveryServerStopped: a node's pull consumer kept in memory on an R3 partition
// loses its state when every server stops at once; once they are back it is there again, delivers the request
// it had not delivered, and not the one acked before (the work queue deleted it).
func TestMemoryNodeConsumerAfterEveryServerStopped(t *testing.T) {
	c := bustest.StartCluster(t, 3, bustest.ClusterName("restart"))
	b := connectCluster(t, c, "operator")
	const node = "node-restart"
	cc := ConsumerConfig(Config{Node: node})
	enqueue := func(b *bus.Bus, image string) {
		t.Helper()
		if _, err := Enqueue(t.Context(), b, node, events.PullRequest{ID: events.NewID(), Image: image, Policy: events.PullIfNotPresent}); err != nil {
			t.Fatal(err)
		}
	}
	// consume runs the consumer on b until it has handled one request, and returns that request's image.
	consume := func(b *bus.Bus) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		got := make(chan string, 10)
		done := make(chan error, 1)
		go func() {
			done <- b.Consume(ctx, cc, func(_ context.Context, m *bus.Msg) error {
				var req events.PullRequest
				if err := json.Unmarshal(m.Data, &req); err != nil {
					return bus.Permanent(err)
				}
				got <- req.Image
				return nil
			})
		}()
		var image string
		select {
		case image = <-got:
		case <-ctx.Done():
			t.Fatal("no request delivered")
		}
		cancel()
		<-done
		return image
	}

	enqueue(b, "registry.example/acked:1")
	if got := consume(b); got != "registry.example/acked:1" {
		t.Fatalf("delivered %s", got)
	}
	st, err := b.Consumer(t.Context(), cc.Stream, cc.Durable)
	if err != nil || !st.MemoryStorage {
		t.Fatalf("consumer %+v (%v), want memory storage", st, err)
	}
	enqueue(b, "registry.example/waiting:1")
	for i := range c.N() {
		c.Stop(i)
	}
	for i := range c.N() {
		c.Start(i)
	}
	after := c.Connect("after")
	if got := consume(after); got != "registry.example/waiting:1" {
		t.Fatalf("after every server stopped, delivered %s first, want the request not delivered before", got)
	}
	bustest.Eventually(t, "nothing left for the node", time.Minute, func() error {
		st, err := after.Consumer(t.Context(), cc.Stream, cc.Durable)
		if err != nil {
			return err
		}
		if st.NumPending != 0 || st.NumAckPending != 0 {
			return fmt.Errorf("consumer %+v", st)
		}
		return nil
	})
}
