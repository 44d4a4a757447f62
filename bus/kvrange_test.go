package bus_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

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
	_, b := bustest.Start(t)
	kv, err := b.KV(t.Context(), bus.KVConfig{Bucket: "rewritten"})
	if err != nil {
		t.Fatal(err)
	}
	const n = 300
	for i := range n {
		if _, err := kv.Put(t.Context(), fmt.Sprintf("k%03d", i), []byte("v")); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ctx.Err() == nil; i = (i + 1) % n {
			if _, err := kv.Put(ctx, fmt.Sprintf("k%03d", i), []byte("v")); err != nil && ctx.Err() == nil {
				t.Errorf("rewrite: %v", err)
				return
			}
		}
	}()
	defer func() { cancel(); <-done }()
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
