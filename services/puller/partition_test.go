package puller

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// pullerConsumer is node's pull consumer exactly as the puller with the default Config makes it.
func pullerConsumer(t testing.TB, node string) bus.ConsumerConfig {
	cfg := Config{Node: node, Logger: slog.New(slog.DiscardHandler)}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	return ConsumerConfig(cfg)
}

// oldAgentConsumer is the pull consumer an agent of the previous release made: PullerDurable on the single
// legacy queue, filtered to the node's legacy subject.
func oldAgentConsumer(t testing.TB, node string) bus.ConsumerConfig {
	cc := pullerConsumer(t, node)
	cc.Stream, cc.FilterSubjects = events.PullStream, []string{events.LegacyPullSubject(node)}
	return cc
}

// TestLegacyQueueDrained: during a rolling upgrade an old CLI still queues pulls on the legacy single queue,
// where the node's old agent made its durable. The new puller binds that durable (creating nothing) and runs
// the queued request, and its own partition's requests; once the operator removes the legacy queue, the
// puller goes on with its partition alone.
func TestLegacyQueueDrained(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	if err := b.EnsureConsumer(ctx, oldAgentConsumer(t, testNode)); err != nil {
		t.Fatal(err)
	}
	// Queued by an old CLI before the new agent starts: nobody consumes it yet.
	if _, err := b.PublishCommand(ctx, events.LegacyPullSubject(testNode), "legacy-1",
		events.PullRequest{ID: "legacy-1", Image: "old-cli-image", Policy: events.PullIfNotPresent}, nil); err != nil {
		t.Fatal(err)
	}
	// The queue metrics count the legacy queue's requests with the partition's while both durables exist.
	if err := b.EnsureConsumer(ctx, pullerConsumer(t, testNode)); err != nil {
		t.Fatal(err)
	}
	if err := publishPull(t, b, events.PullRequest{ID: "new-0", Image: "new-cli-image-0", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewQueueCollector(b, []string{testNode}))
	// The consumers' pending counts follow the stores a moment later.
	bustest.Eventually(t, "queue depth of both queues", 10*time.Second, func() error {
		return testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP imagefleet_pull_queue_depth Pull commands waiting in the node's work queue.
# TYPE imagefleet_pull_queue_depth gauge
imagefleet_pull_queue_depth{node="node-a.example"} 2
`), "imagefleet_pull_queue_depth")
	})
	rt := newFakeImages()
	startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, b)
	for id, r := range collectResults(t, sub, []string{"new-0", "legacy-1"}, 10*time.Second) {
		if r.Error != "" || !r.Pulled {
			t.Errorf("%s, queued before the new agent: %+v", id, r)
		}
	}
	// And one the old CLI queues while the new agent runs, and one a new CLI queues on the partition.
	if _, err := b.PublishCommand(ctx, events.LegacyPullSubject(testNode), "legacy-2",
		events.PullRequest{ID: "legacy-2", Image: "old-cli-image-2", Policy: events.PullIfNotPresent}, nil); err != nil {
		t.Fatal(err)
	}
	if err := publishPull(t, b, events.PullRequest{ID: "new-1", Image: "new-cli-image", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	for id, r := range collectResults(t, sub, []string{"legacy-2", "new-1"}, 10*time.Second) {
		if r.Error != "" || !r.Pulled {
			t.Errorf("%s: %+v", id, r)
		}
	}
	// The legacy queue is empty: what the upgrade notes tell the operator to check before removing it.
	bustest.Eventually(t, "legacy queue empty", 10*time.Second, func() error {
		st, err := b.Stream(ctx, events.PullStream)
		if err != nil {
			return err
		}
		if st.Messages != 0 {
			return fmt.Errorf("legacy queue holds %d messages", st.Messages)
		}
		return nil
	})
	if err := b.DeleteStream(ctx, events.PullStream); err != nil {
		t.Fatal(err)
	}
	if err := publishPull(t, b, events.PullRequest{ID: "new-2", Image: "after-removal", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "new-2", 10*time.Second); r.Error != "" || !r.Pulled {
		t.Fatalf("request after the legacy queue's removal: %+v", r)
	}
	if n := rt.pulls.Load(); n != 5 {
		t.Errorf("runtime pulls = %d, want 5 (each request once)", n)
	}
}

// TestNoLegacyDurableCreated: a new agent on a node that never ran an old one creates no legacy durable, so a
// request on the legacy queue stays there (it is the old agent's to run) and the legacy stream's consumer
// count does not grow with the fleet.
func TestNoLegacyDurableCreated(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "p1", Image: "img", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	nextResult(t, sub, "p1", 10*time.Second)
	// Give the legacy drain, started with the partition's consumer, every chance to have made one.
	time.Sleep(300 * time.Millisecond)
	if _, err := b.Consumer(t.Context(), events.PullStream, events.PullerDurable(testNode)); !bus.IsConsumerNotFound(err) {
		t.Fatalf("legacy durable lookup: %v, want not found", err)
	}
	if st, err := b.Stream(t.Context(), events.PullStream); err != nil || st.Consumers != 0 {
		t.Fatalf("legacy stream: %+v %v, want no consumers", st, err)
	}
	if st, err := b.Stream(t.Context(), events.PullStreamOf(testNode)); err != nil || st.Consumers != 1 {
		t.Fatalf("partition stream: %+v %v, want the node's consumer", st, err)
	}
}

// makeConsumers makes the pull consumers of nodes hollow-0 .. hollow-<n-1> with mk, with a few at a time
// (as agents starting together would); it returns how many were made before the first failure and that error.
func makeConsumers(ctx context.Context, b *bus.Bus, n int, mk func(node string) bus.ConsumerConfig) (int, error) {
	var (
		made     atomic.Int64
		firstErr error
		mu       sync.Mutex
		wg       sync.WaitGroup
	)
	next := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := b.EnsureConsumer(ctx, mk(fmt.Sprintf("hollow-%d", i))); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("node hollow-%d: %w", i, err)
					}
					mu.Unlock()
					continue
				}
				made.Add(1)
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return int(made.Load()), firstErr
}

// TestPullersPastOneThousand: 1,200 nodes each hold their pull consumer, made exactly as the puller makes it
// (ConsumerConfig), on one nats-server with its default limits; a request to node hollow-1150, whose
// consumer came after the first 1,000, is delivered to that node's real puller and acked. On the single
// legacy queue the same 1,200 consumers stop at 1,000: the server refuses the 1,001st (err_code 10026), which
// is why the queue is partitioned.
func TestPullersPastOneThousand(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	// Removing the streams first takes well under a second; a nats-server shut down holding 2,200 file-store
	// consumers takes over 20 s.
	t.Cleanup(func() {
		for p := range events.PullPartitions {
			_ = b.DeleteStream(context.Background(), events.PullPartitionStream(p))
		}
		_ = b.DeleteStream(context.Background(), events.PullStream)
	})
	ctx := t.Context()
	const nodes = 1200
	began := time.Now()
	made, err := makeConsumers(ctx, b, nodes, func(node string) bus.ConsumerConfig {
		return pullerConsumer(t, node)
	})
	if err != nil || made != nodes {
		t.Fatalf("partitioned: %d of %d consumers made: %v", made, nodes, err)
	}
	t.Logf("%d partitioned consumers made in %s", nodes, time.Since(began).Round(time.Millisecond))
	total := 0
	for p := range events.PullPartitions {
		st, err := b.Stream(ctx, events.PullPartitionStream(p))
		if err != nil {
			t.Fatal(err)
		}
		if st.MaxConsumers != events.PullPartitionMaxConsumers {
			t.Errorf("%s: MaxConsumers %d, want %d", st.Name, st.MaxConsumers, events.PullPartitionMaxConsumers)
		}
		total += st.Consumers
	}
	if total != nodes {
		t.Errorf("consumers across the partitions = %d, want %d", total, nodes)
	}

	// The real puller of a node past the old limit.
	const node = "hollow-1150"
	cfg := Config{Node: node, Logger: slog.New(slog.DiscardHandler), Registerer: prometheus.NewRegistry()}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	s, err := newService(cfg, newFakeImages(), b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunService(t, s)
	sub, err := b.SubscribeSync(ctx, events.EventSubject(node, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if _, err := Enqueue(ctx, b, node, events.PullRequest{ID: "past-1000", Image: "img", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "past-1000", 10*time.Second); r.Error != "" || !r.Pulled {
		t.Fatalf("request to %s: %+v", node, r)
	}
	bustest.Eventually(t, "the request acked", 10*time.Second, func() error {
		st, err := b.Consumer(ctx, events.PullStreamOf(node), events.PullerDurable(node))
		if err != nil {
			return err
		}
		if st.NumPending != 0 || st.NumAckPending != 0 {
			return fmt.Errorf("consumer of %s: %+v", node, st)
		}
		return nil
	})

	// The same fleet on the legacy single queue.
	began = time.Now()
	made, err = makeConsumers(ctx, b, nodes, func(node string) bus.ConsumerConfig { return oldAgentConsumer(t, node) })
	t.Logf("legacy queue: %d consumers made in %s, then: %v", made, time.Since(began).Round(time.Millisecond), err)
	if made != 1000 || !bus.IsMaxConsumers(err) {
		t.Fatalf("legacy queue: %d consumers made, first error %v; want 1,000 and then the server's consumer limit", made, err)
	}
}
