package bus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestBucketTakesAWatcherPerNodePastOneThousand: 1,200 nodes read their own keys of one shared bucket at
// once (the detector loading its records at start holds a watcher while it reads). A bucket made by KV
// takes them all; a bucket made as before, with the server's default limit, refuses the 1,001st with
// err_code 10026 until RaiseBucketConsumers lifts it (what `imagefleet bus init` does to an earlier
// release's buckets).
//
// It waits for each watcher to say it started (its initial-values marker: its consumer made and answered)
// or failed, however long a loaded machine takes, instead of counting consumers for a fixed 20 s: under
// -race beside CPU hogs that window once ended at 1,199 of 1,200. A watcher that does neither while none of
// the others moves either for watcherStall, twice the bus's most patient attempt (a minute, after attempts of
// 5, 10, 20 and 40 s timed out on a server too loaded to answer sooner), is a request never answered: a
// defect, reported as such.
func TestBucketTakesAWatcherPerNodePastOneThousand(t *testing.T) {
	const (
		nodes        = 1200
		watcherStall = 2 * time.Minute
	)
	srv, b := bustest.Start(t)
	ctx := t.Context()
	_, js := bustest.JetStream(t, srv)

	// watchAll starts a watcher per node, each on its own keys, waits until every one has started or failed,
	// and calls check with the errors of those that failed (a refusal is not retried: IsMaxConsumers says
	// which) while the others still run.
	watchAll := func(kv *bus.KV, check func(failed []error)) {
		t.Helper()
		wctx, wcancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		defer func() { wcancel(); wg.Wait() }()
		var (
			mu       sync.Mutex
			started  int
			failed   []error
			lastMove = time.Now()
		)
		for i := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				marked := false
				err := kv.Watch(wctx, fmt.Sprintf("n%05d.>", i), func(_ bus.Entry, initialDone bool) {
					if initialDone && !marked {
						marked = true
						mu.Lock()
						started, lastMove = started+1, time.Now()
						mu.Unlock()
					}
				})
				if err != nil {
					mu.Lock()
					failed, lastMove = append(failed, err), time.Now()
					mu.Unlock()
				}
			}()
		}
		bustest.Eventually(t, fmt.Sprintf("each of %d watchers started or failed", nodes), 2*watcherStall, func() error {
			mu.Lock()
			defer mu.Unlock()
			if started+len(failed) == nodes {
				return nil
			}
			if stalled := time.Since(lastMove); stalled > watcherStall {
				t.Fatalf("%d watchers started, %d failed, %d neither, and none moved for %v: their requests are never answered",
					started, len(failed), nodes-started-len(failed), stalled.Round(time.Second))
			}
			return fmt.Errorf("%d started, %d failed", started, len(failed))
		})
		mu.Lock()
		failedNow := failed
		mu.Unlock()
		check(failedNow)
	}
	// consumers is how many consumers the bucket's stream holds: the server's side of the watchers' count.
	consumers := func(bucket string) int {
		t.Helper()
		s, err := js.Stream(ctx, "KV_"+bucket)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Consumers
	}
	// takesAll checks that every watcher of kv started, and that its bucket's stream holds them all (an
	// ordered consumer nats.go makes anew is missing for a moment).
	takesAll := func(what, bucket string, kv *bus.KV) {
		t.Helper()
		watchAll(kv, func(failed []error) {
			if len(failed) > 0 {
				t.Fatalf("%d watchers on %s: %d failed, the first: %v", nodes, what, len(failed), failed[0])
			}
			bustest.WaitFor(t, fmt.Sprintf("%d consumers on %s's stream", nodes, what), func() bool {
				return consumers(bucket) >= nodes
			})
		})
	}

	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "shared-new"})
	if err != nil {
		t.Fatal(err)
	}
	takesAll("a bucket made by KV", "shared-new", kv)

	// A bucket of an earlier release: made without the limit.
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "shared-old"}); err != nil {
		t.Fatal(err)
	}
	old, err := b.KV(ctx, bus.KVConfig{Bucket: "shared-old"})
	if err != nil {
		t.Fatal(err)
	}
	watchAll(old, func(failed []error) {
		if len(failed) == 0 {
			t.Fatalf("%d watchers on a bucket with the server's default limit: none refused, want the limit (the test cannot tell)", nodes)
		}
		for _, err := range failed {
			if !bus.IsMaxConsumers(err) {
				t.Fatalf("a watcher on a bucket with the server's default limit failed with %v, want the limit (err_code 10026)", err)
			}
		}
	})
	if err := b.RaiseBucketConsumers(ctx, "shared-old"); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, "KV_shared-old")
	if err != nil {
		t.Fatal(err)
	}
	if got := s.CachedInfo().Config.MaxConsumers; got != events.SharedStreamMaxConsumers {
		t.Fatalf("raised limit %d, want %d", got, events.SharedStreamMaxConsumers)
	}
	takesAll("a bucket after RaiseBucketConsumers", "shared-old", old)
}
