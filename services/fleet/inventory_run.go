package fleet

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Run applies events, keeps the index and answers queries until ctx ends.
func (s *Inventory) Run(ctx context.Context) error {
	// The first part to fail stops the others; an error after the stop is the stop's, not reported.
	g, ctx := errgroup.WithContext(ctx)
	s.runCtx = ctx
	// indexed: the index holds the bucket's initial contents. loaded: and the replica listens for queries
	// (ready); events are applied and partitions consumed from then on.
	indexed, loaded := make(chan struct{}), make(chan struct{})
	run := func(name string, f func() error) {
		g.Go(func() error {
			if err := f(); err != nil && ctx.Err() == nil {
				return fmt.Errorf("inventory %s: %w", name, err)
			}
			return nil
		})
	}
	// atStart: the initial load found node-first keys of the previous release (compat_nodefirst_keys.go).
	var atStart atomic.Bool
	if s.owners != nil {
		// Partitioned: the partitions are taken first, so the initial watch loads just theirs.
		run("owners", func() error { return s.owners.run(ctx) })
		run("partition consumers", func() error { return s.partitionFailure(ctx) })
	}
	run("watch", func() error { return s.watch(ctx, indexed, &atStart) })
	run("rekey", func() error { return s.runRekey(ctx, indexed, &atStart) })
	if !s.cfg.Partitioned {
		run("consume", func() error { return s.consume(ctx, loaded) })
	}
	run("query", func() error { return s.serve(ctx, indexed, loaded) })
	err := g.Wait() // ends ctx, so the partition consumers and range loads end too
	s.cmu.Lock()
	s.stopped = true
	s.cmu.Unlock()
	s.cwg.Wait()
	return err
}

// partitionFailure returns the first error of a partition consumer, or nil when ctx ends.
func (s *Inventory) partitionFailure(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case err := <-s.fail:
		return err
	}
}

// watch indexes the bucket: its initial contents (then closes indexed), then every change. A node-first key
// of the previous release found by the initial load sets atStart; one written later is queued for the
// re-keyer.
func (s *Inventory) watch(ctx context.Context, indexed chan<- struct{}, atStart *atomic.Bool) error {
	if s.owners != nil {
		select {
		case <-ctx.Done():
			return nil
		case <-s.owners.first:
		}
	}
	s.mu.Lock()
	s.watching = true
	s.mu.Unlock()
	var once sync.Once
	loadedAll := false // the watch callback's own: the initial values are done
	return s.kv.Watch(ctx, ">", func(e bus.Entry, initialDone bool) {
		if initialDone {
			// A node-first key is indexed under its image-first key at once: the index is whole now,
			// whether or not the re-keying is done.
			loadedAll = true
			once.Do(func() { close(indexed) })
			return
		}
		p, ok := s.indexEntry(e)
		switch {
		case !ok:
		case !loadedAll:
			atStart.Store(true)
		default:
			s.queueRekey(e, p)
		}
	})
}

// consume applies the image events of the shared durable once the index is loaded.
//
// Events are applied once the index is loaded: an apply reads the key's sequence and revision from the
// index (an event the bucket already reflects costs no request; another is one compare-and-set). Either
// way an applied event is acked without waiting for the server's confirmation (AsyncAck): the apply is
// idempotent (the sequence guard), so an ack the server never got only redelivers an event whose second
// apply changes nothing, and a handler's slot is not held for the ack's Raft round on the consumer's
// group (~10 ms of the ~25 ms an event held it during a catch-up: docs/benchmarks.md).
func (s *Inventory) consume(ctx context.Context, loaded <-chan struct{}) error {
	if !waitLoaded(ctx, loaded) {
		return nil
	}
	return s.b.Consume(ctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: events.InventoryDurable,
		FilterSubjects: []string{events.ImageEventsFilter}, MaxAckPending: 4 * s.cfg.Concurrency,
		Concurrency: s.cfg.Concurrency, MaxDeliver: 10, Backoff: inventoryBackoff,
		AsyncAck: true},
		s.Apply)
}

// serve answers queries once the index is loaded, says the replica is ready, starts the consumers of the
// partitions the initial load made ready, and closes loaded.
//
// Queries are listened for only once the index is loaded, so a starting replica never answers from half an
// inventory while another replica could answer from all of it. The replica says it is ready (Ready, Owned,
// events applied) only once the server holds its subscriptions, so a query sent on that word finds a
// responder instead of being refused with no responders.
func (s *Inventory) serve(ctx context.Context, indexed <-chan struct{}, loaded chan<- struct{}) error {
	if !waitLoaded(ctx, indexed) {
		return nil
	}
	ls, err := s.listen(ctx)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.ready = true
	ready := s.initialLoaded()
	s.mu.Unlock()
	s.readyOnce.Do(func() { close(s.readyCh) })
	for _, p := range ready {
		s.startConsumer(p)
	}
	close(loaded)
	var wg sync.WaitGroup
	for _, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = l.Serve(ctx) // nil once ctx ends
		}()
	}
	wg.Wait()
	return nil
}

// listen subscribes to every subject this replica answers: queries, in their queue group, and (partitioned)
// parts, which every replica answers. A listener is registered at the server when it is returned.
func (s *Inventory) listen(ctx context.Context) ([]*bus.Listener, error) {
	q, err := s.b.Listen(ctx, events.InventoryQuerySubject, events.InventoryQueue, 4, s.Query)
	if err != nil {
		return nil, err
	}
	if s.owners == nil {
		return []*bus.Listener{q}, nil
	}
	parts, err := s.b.Listen(ctx, events.InventoryPartsSubject, "", 4, s.Part)
	if err != nil {
		q.Close()
		return nil, err
	}
	return []*bus.Listener{q, parts}, nil
}

// inventoryBackoff is the redelivery backoff of an event whose apply failed.
var inventoryBackoff = []time.Duration{100 * time.Millisecond, time.Second, 5 * time.Second}

// inventoryPartitionMaxAckPending bounds a partition durable's events in flight: its owner's 16 handlers,
// with room for a previous owner's unacked events during a handover (and for replicas of the previous
// release, which pulled from every partition, 16 of them at 16 each). An event counts from its delivery until the server has its ack; with the
// acks not waited for (AsyncAck), a replica's handlers may start new events while acks of theirs are still
// on the way, and the server holds back deliveries past the bound as before.
const inventoryPartitionMaxAckPending = 256

// inventoryStallAfter is the partitions' StallAfter: how long a partition whose pull request never reached
// its consumer's leader sits idle before the replica pulls anew. A partition durable just created on a
// cluster sometimes lost its replica's first pull request (no pull request waiting at the server, the
// whole partition pending); with the bus's default of 15 s the catch-up waited 15-20 s for that one
// partition (docs/benchmarks.md: 20.9 s instead of ~5 s at 1 replica), the other 15 long done. The price is
// the watchdog's consumer info requests: a look 2 s after a partition's last delivery, then at periods that
// double up to 5 minutes, 16 per replica at most per period.
const inventoryStallAfter = 2 * time.Second

// inventoryAckWait is how long a partition's copy stays with a replica that stopped answering before the
// server hands it to another (an apply takes milliseconds; the shared durable keeps the default 30 s).
const inventoryAckWait = 10 * time.Second

func waitLoaded(ctx context.Context, loaded <-chan struct{}) bool {
	select {
	case <-ctx.Done():
		return false
	case <-loaded:
		return true
	}
}
