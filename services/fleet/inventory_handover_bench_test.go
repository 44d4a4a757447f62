package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// BenchmarkInventoryHandover measures what a query sees while partitioned replicas hand partitions over,
// over 10,000 nodes x 50 images (500,000 placements written with direct KV puts) on a real embedded
// nats-server:
//
//   - cold-s (the baseline): one replica started over the full bucket, until a query answers for every
//     node with every placement indexed;
//   - join-s: a second replica started, until the two answer whole again with all placements indexed
//     between them (r1 gives up 8 partitions, r2 takes and loads them: its settle tick, then its watch);
//   - stop-s: the second replica stopped, until r1 answers alone for all 16 (it takes them at its next
//     renewal and reads them with a range over the bucket);
//   - join-query-max-s: the longest of the queries asked one after another during the join (each must
//     answer every node);
//   - stop-query-s: how long a query asked right after the stop took (it waits inside the gather; it must
//     succeed).
//
// join-x and stop-x are the ratios to cold-s.
func BenchmarkInventoryHandover(b *testing.B) {
	const nodes, perNode = 10000, 50
	for range b.N {
		srv := bustest.Server(b)
		ctx, cancel := context.WithCancel(context.Background())
		newReplica := func(name string) *Inventory {
			inv, err := NewInventory(ctx, InventoryConfig{Replica: name, Partitioned: true}, bustest.Connect(b, srv))
			if err != nil {
				b.Fatal(err)
			}
			return inv
		}
		r1 := newReplica("r1")
		puts := map[string][]byte{}
		for n := range nodes {
			node := fmt.Sprintf("hollow-%d", n)
			for j := range perNode {
				p := events.Placement{Node: node, ID: fmt.Sprintf("sha256:%064x", j), RepoTags: []string{fmt.Sprintf("registry.example/app-%d:v1", j)},
					Size: int64(10<<20 + j), LastUsed: time.Now().UTC(), Seq: uint64(n*perNode + j + 1)}
				raw, _ := json.Marshal(p)
				puts[events.InventoryKey(p.ID, node)] = raw
			}
			if len(puts) >= 2000 {
				if err := r1.kv.Batch(ctx, puts, nil); err != nil {
					b.Fatal(err)
				}
				puts = map[string][]byte{}
			}
		}
		if err := r1.kv.Batch(ctx, puts, nil); err != nil {
			b.Fatal(err)
		}
		client := bustest.Connect(b, srv)
		whole := func(invs ...*Inventory) bool {
			indexed := 0
			for _, inv := range invs {
				n, _ := inv.Indexed()
				indexed += n
			}
			if indexed != nodes*perNode {
				return false
			}
			qctx, qcancel := context.WithTimeout(ctx, 30*time.Second)
			defer qcancel()
			var rep events.InventoryReply
			err := client.Request(qctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryNodes, Limit: 1}, &rep)
			return err == nil && rep.Total == nodes
		}
		until := func(what string, f func() bool) time.Duration {
			start := time.Now()
			for !f() {
				if time.Since(start) > 5*time.Minute {
					b.Fatalf("%s: not whole after 5 minutes", what)
				}
				time.Sleep(20 * time.Millisecond)
			}
			return time.Since(start)
		}
		start := time.Now()
		stop1 := bustest.RunService(b, r1)
		cold := until("one replica", func() bool { return whole(r1) })
		r2 := newReplica("r2")
		// Queries asked one after another for as long as the join lasts: the longest is what a client
		// waits while partitions change hands (a gather waits inside for the parts to cover every
		// partition again).
		polling, polled := make(chan struct{}), make(chan struct{})
		var slowest time.Duration
		var pollErr error
		go func() {
			defer close(polled)
			for {
				select {
				case <-polling:
					return
				default:
				}
				t0 := time.Now()
				var rep events.InventoryReply
				qctx, qcancel := context.WithTimeout(ctx, 30*time.Second)
				err := client.Request(qctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryNodes, Limit: 1}, &rep)
				qcancel()
				if err == nil && rep.Total != nodes {
					err = fmt.Errorf("total %d, want %d", rep.Total, nodes)
				}
				if err != nil {
					pollErr = err
					return
				}
				slowest = max(slowest, time.Since(t0))
				time.Sleep(10 * time.Millisecond)
			}
		}()
		start = time.Now()
		stop2 := bustest.RunService(b, r2)
		join := until("a second replica joined", func() bool {
			return len(r1.Owned()) == events.InventoryPartitions/2 && len(r2.Owned()) == events.InventoryPartitions/2 && whole(r1, r2)
		})
		close(polling)
		<-polled
		if pollErr != nil {
			b.Fatalf("a query during the join: %v", pollErr)
		}
		start = time.Now()
		stop2()
		var rep events.InventoryReply
		qctx, qcancel := context.WithTimeout(ctx, 30*time.Second)
		err := client.Request(qctx, events.InventoryQuerySubject, events.InventoryQuery{What: events.InventoryNodes, Limit: 1}, &rep)
		qcancel()
		query := time.Since(start)
		if err != nil || rep.Total != nodes {
			b.Fatalf("a query right after the second replica stopped: %v (total %d), want every node", err, rep.Total)
		}
		stopped := until("the second replica stopped", func() bool {
			return len(r1.Owned()) == events.InventoryPartitions && whole(r1)
		}) + query
		stop1()
		cancel()
		b.ReportMetric(cold.Seconds(), "cold-s")
		b.ReportMetric(join.Seconds(), "join-s")
		b.ReportMetric(stopped.Seconds(), "stop-s")
		b.ReportMetric(query.Seconds(), "stop-query-s")
		b.ReportMetric(slowest.Seconds(), "join-query-max-s")
		b.ReportMetric(join.Seconds()/cold.Seconds(), "join-x")
		b.ReportMetric(stopped.Seconds()/cold.Seconds(), "stop-x")
	}
}
