package bus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
func TestBucketTakesAWatcherPerNodePastOneThousand(t *testing.T) {
	const nodes = 1200
	srv, b := bustest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}

	// watchAll starts a watcher per node, each on its own keys, and reports whether all of them exist within
	// 20 s (a refused one is retried by KV.Watch as the cluster case needs, so a limit shows as a shortfall).
	watchAll := func(bucket string, kv *bus.KV) error {
		wctx, wcancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		defer func() { wcancel(); wg.Wait() }()
		for i := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = kv.Watch(wctx, fmt.Sprintf("n%05d.>", i), func(bus.Entry, bool) {})
			}()
		}
		var n int
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			s, err := js.Stream(ctx, "KV_"+bucket)
			if err != nil {
				return err
			}
			info, err := s.Info(ctx)
			if err != nil {
				return err
			}
			if n = info.State.Consumers; n >= nodes {
				return nil
			}
			time.Sleep(200 * time.Millisecond)
		}
		return fmt.Errorf("%d of %d watchers started", n, nodes)
	}

	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "shared-new"})
	if err != nil {
		t.Fatal(err)
	}
	if err := watchAll("shared-new", kv); err != nil {
		t.Fatalf("%d watchers on a bucket made by KV: %v", nodes, err)
	}

	// A bucket of an earlier release: made without the limit.
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "shared-old"}); err != nil {
		t.Fatal(err)
	}
	old, err := b.KV(ctx, bus.KVConfig{Bucket: "shared-old"})
	if err != nil {
		t.Fatal(err)
	}
	if err := watchAll("shared-old", old); err == nil {
		t.Fatalf("%d watchers on a bucket with the server's default limit: no error, want the limit (the test cannot tell)", nodes)
	}
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
	if err := watchAll("shared-old", old); err != nil {
		t.Fatalf("%d watchers after RaiseBucketConsumers: %v", nodes, err)
	}
}
