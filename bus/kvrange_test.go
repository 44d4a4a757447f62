package bus_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestKVRange: Range streams the live entries matching a key filter (deleted keys left out) and stops when
// fn returns false.
func TestKVRange(t *testing.T) {
	_, b := bustest.Start(t)
	kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: "range-test"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		if _, err := kv.Put(t.Context(), fmt.Sprintf("a.k%d", i), []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := kv.Put(t.Context(), "b.k0", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(t.Context(), "a.k3"); err != nil {
		t.Fatal(err)
	}
	var keys []string
	if err := kv.Range(t.Context(), "a.*", func(e bus.Entry) bool { keys = append(keys, e.Key); return true }); err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	if want := []string{"a.k0", "a.k1", "a.k2", "a.k4", "a.k5"}; !slices.Equal(keys, want) {
		t.Fatalf("keys %v, want %v", keys, want)
	}
	n := 0
	if err := kv.Range(t.Context(), ">", func(bus.Entry) bool { n++; return n < 2 }); err != nil || n != 2 {
		t.Fatalf("early stop: %d entries, %v", n, err)
	}
}

// TestRangeWhileKeysAreRewritten: while every key of a bucket is rewritten over and over, Range and List
// still give every key (the server's pending count alone left out the key rewritten as the watch began,
// one time in a few dozen), Range at least once, List exactly once with its latest value seen.
func TestRangeWhileKeysAreRewritten(t *testing.T) {
	const n = 300
	kv, put := filledBucket(t, "rewritten", n, putKey)
	stop := rewriteLoop(t, n, put)
	defer stop()
	for round := range 150 {
		got := map[string]int{}
		if err := kv.Range(t.Context(), ">", func(e bus.Entry) bool { got[e.Key]++; return true }); err != nil {
			t.Fatal(err)
		}
		if len(got) != n {
			t.Fatalf("round %d: Range gave %d of %d keys", round, len(got), n)
		}
		entries, err := kv.List(t.Context(), "")
		if err != nil {
			t.Fatal(err)
		}
		keys := make([]string, len(entries))
		for i, e := range entries {
			keys[i] = e.Key
		}
		if uniq := slices.Compact(slices.Sorted(slices.Values(keys))); len(keys) != n || len(uniq) != n {
			t.Fatalf("round %d: List gave %d entries, %d distinct keys; want %d once each", round, len(keys), len(uniq), n)
		}
	}
}

// TestRangeFilteredReadsOnlyToItsKeys: a filtered Range or List reads on to the last revision of the keys
// it covers, not the bucket's: with other keys written last, it neither misses its own rewritten keys nor
// waits for an entry it will never be sent (150 of each, well under a second each).
func TestRangeFilteredReadsOnlyToItsKeys(t *testing.T) {
	const n = 100
	kv, put := filledBucket(t, "filtered", n, func(kv *bus.KV) func(context.Context, int) error {
		return func(ctx context.Context, i int) error {
			for _, p := range []string{"a", "b"} { // "b" is written last
				if _, err := kv.Put(ctx, fmt.Sprintf("%s.k%03d", p, i), []byte("v")); err != nil {
					return err
				}
			}
			return nil
		}
	})
	stop := rewriteLoop(t, n, put)
	defer stop()
	began := time.Now()
	for round := range 150 {
		got := map[string]bool{}
		if err := kv.Range(t.Context(), "a.>", func(e bus.Entry) bool { got[e.Key] = true; return true }); err != nil {
			t.Fatal(err)
		}
		entries, err := kv.List(t.Context(), "a.>")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != n || len(entries) != n {
			t.Fatalf("round %d: Range gave %d keys, List %d; want %d", round, len(got), len(entries), n)
		}
	}
	if took := time.Since(began); took > time.Minute {
		t.Errorf("150 filtered ranges and lists took %v: waiting for entries they are not sent", took)
	}
	// Quiet now, a "b" key written last: nothing more is coming for "a.>".
	stop()
	if err := put(t.Context(), 0); err != nil {
		t.Fatal(err)
	}
	began = time.Now()
	for range 10 {
		if err := kv.Range(t.Context(), "a.>", func(bus.Entry) bool { return true }); err != nil {
			t.Fatal(err)
		}
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Errorf("10 filtered ranges of a quiet bucket took %v: each waited for the bucket's last key, not one of its own", took)
	}
}

// rewriteLoop calls put for keys 0..n-1 over and over in the background until stop is called (stop may be
// called again, and waits for the loop to end).
func rewriteLoop(t *testing.T, n int, put func(ctx context.Context, i int) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ctx.Err() == nil; i = (i + 1) % n {
			if err := put(ctx, i); err != nil && ctx.Err() == nil {
				t.Errorf("rewrite: %v", err)
				return
			}
		}
	}()
	return func() { cancel(); <-done }
}

// TestWatchMarksInitialDoneAfterEveryKeyWhileRewritten: while every key of a bucket is rewritten over and
// over, Watch passes on every key before its initial-values marker (nats.go's own marker came one rewritten
// key early, as the range did before readInitial), then goes on with changes; on a quiet bucket the marker
// comes at once.
func TestWatchMarksInitialDoneAfterEveryKeyWhileRewritten(t *testing.T) {
	const n = 300
	kv, put := filledBucket(t, "watched", n, putKey)
	// watch returns the keys passed on before the marker and whether a change came after it.
	watch := func() (before map[string]bool, changeAfter bool, took time.Duration) {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		before = map[string]bool{}
		marked := false
		began := time.Now()
		err := kv.Watch(ctx, ">", func(e bus.Entry, initialDone bool) {
			switch {
			case initialDone:
				marked, took = true, time.Since(began)
				if _, err := kv.Put(ctx, "after", []byte("v")); err != nil {
					t.Errorf("put after the marker: %v", err)
				}
			case !marked:
				before[e.Key] = true
			case e.Key == "after":
				changeAfter = true
				cancel()
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		if !marked {
			t.Fatal("no initial-values marker in 10 s")
		}
		return before, changeAfter, took
	}
	stop := rewriteLoop(t, n, put)
	defer stop()
	for round := range 150 {
		before, changeAfter, _ := watch()
		delete(before, "after")
		if len(before) != n || !changeAfter {
			t.Fatalf("round %d: %d of %d keys before the marker, a change after it: %v", round, len(before), n, changeAfter)
		}
	}
	stop()
	for range 5 {
		if _, _, took := watch(); took > time.Second {
			t.Errorf("marker of a quiet bucket after %v: it waited for an entry that was not coming", took)
		}
	}
}

// filledBucket opens bucket on a server of its own and writes keys 0..n-1 once with the put putOf makes for
// it, which it returns for the test to go on rewriting them with.
func filledBucket(t *testing.T, bucket string, n int, putOf func(*bus.KV) func(context.Context, int) error) (*bus.KV, func(context.Context, int) error) {
	t.Helper()
	_, b := bustest.Start(t)
	kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: bucket})
	if err != nil {
		t.Fatal(err)
	}
	put := putOf(kv)
	for i := range n {
		if err := put(t.Context(), i); err != nil {
			t.Fatal(err)
		}
	}
	return kv, put
}

// putKey writes key k<i> (three digits).
func putKey(kv *bus.KV) func(context.Context, int) error {
	return func(ctx context.Context, i int) error {
		_, err := kv.Put(ctx, fmt.Sprintf("k%03d", i), []byte("v"))
		return err
	}
}

// TestRangeMakesALostWatcherAgain: a request of Range lost on its way (a loaded server's JetStream API
// drops what it cannot queue) is asked again after AttemptTimeout, within the caller's deadline. nats.go
// waited for the answer to the watcher's create request until the caller's deadline, and `fleet nodes` (30 s)
// ended with "kv range imagefleet-nodes-seen/>: context deadline exceeded"; the bucket's status, read for its
// last revision, waited the same way.
func TestRangeMakesALostWatcherAgain(t *testing.T) {
	const bucket, n = "lost-range", 20
	for _, tc := range []struct {
		name, lost string // lost: the subject prefix of the request lost
	}{
		{"the watcher's create request", "$JS.API.CONSUMER.CREATE.KV_" + bucket + "."},
		{"the bucket's status for its last revision", "$JS.API.STREAM.INFO.KV_" + bucket},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := bustest.Server(t)
			proxy := bustest.NewProxy(t, srv)
			b, err := bus.Connect(t.Context(), proxy.URL(), bus.Options{Name: t.Name()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(b.Close)
			kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: bucket})
			if err != nil {
				t.Fatal(err)
			}
			for i := range n {
				if _, err := kv.Put(t.Context(), fmt.Sprintf("k%02d", i), []byte("v")); err != nil {
					t.Fatal(err)
				}
			}
			lost := proxy.DropNext(1, func(subject string) bool { return strings.HasPrefix(subject, tc.lost) })
			// Three attempts' worth: the old wait for the lost answer took all of it.
			ctx, cancel := context.WithTimeout(t.Context(), 3*bus.AttemptTimeout)
			defer cancel()
			got := map[string]bool{}
			if err := kv.Range(ctx, ">", func(e bus.Entry) bool { got[e.Key] = true; return true }); err != nil {
				t.Fatalf("Range with its request lost: %v", err)
			}
			select {
			case <-lost:
			default:
				t.Fatalf("no request to %s* was sent, so none was lost: the test cannot tell", tc.lost)
			}
			if len(got) != n {
				t.Fatalf("Range gave %d keys, want %d", len(got), n)
			}
		})
	}
}
