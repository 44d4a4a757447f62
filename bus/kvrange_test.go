package bus_test

import (
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
