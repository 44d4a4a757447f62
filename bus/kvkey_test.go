package bus_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

func TestGetKeyReadsOneKeyWithoutOpeningTheBucket(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	if _, err := b.GetKey(ctx, "follow-test", "node-a"); !errors.Is(err, bus.ErrBucketNotFound) {
		t.Fatalf("missing bucket: err = %v, want ErrBucketNotFound", err)
	}
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "follow-test"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.GetKey(ctx, "follow-test", "node-a"); !errors.Is(err, bus.ErrKeyNotFound) {
		t.Fatalf("missing key: err = %v, want ErrKeyNotFound", err)
	}
	rev, err := kv.Put(ctx, "node-a", []byte("v1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "node-b", []byte("other")); err != nil {
		t.Fatal(err)
	}
	e, err := b.GetKey(ctx, "follow-test", "node-a")
	if err != nil || string(e.Value) != "v1" || e.Revision != rev || e.Deleted || e.Created.IsZero() {
		t.Fatalf("GetKey = %+v, %v; want v1 at revision %d", e, err, rev)
	}
	if err := kv.Delete(ctx, "node-a"); err != nil {
		t.Fatal(err)
	}
	e, err = b.GetKey(ctx, "follow-test", "node-a")
	if err != nil || !e.Deleted || e.Value != nil || e.Revision <= rev {
		t.Fatalf("after delete: GetKey = %+v, %v; want a deletion past revision %d", e, err, rev)
	}
}

// follower records what FollowKey passes on.
type follower struct {
	mu  sync.Mutex
	got []string
}

func (f *follower) fn(e bus.Entry, found bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !found {
		f.got = append(f.got, "-")
		return
	}
	f.got = append(f.got, string(e.Value))
}

func (f *follower) wait(t *testing.T, what string, want ...string) {
	t.Helper()
	bustest.Eventually(t, what, 10*time.Second, func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if fmt.Sprint(f.got) != fmt.Sprint(want) {
			return fmt.Errorf("passed on %q", f.got)
		}
		return nil
	})
}

// TestFollowKeyByNotices follows a key whose bucket does not exist yet, with an hour between resyncs: each
// write reaches the follower by its notice alone, a write with no notice waits for the next notice, and
// the same revision is passed on once.
func TestFollowKeyByNotices(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	var f follower
	done := make(chan error, 1)
	fctx, cancel := context.WithCancel(ctx)
	go func() {
		done <- b.FollowKey(fctx, bus.KeyFollowerConfig{Bucket: "follow-test", Key: "node-a", Notices: "test.notice.node-a",
			Resync: time.Hour, Retry: 10 * time.Millisecond}, f.fn)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("FollowKey: %v", err)
		}
	})
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "follow-test"})
	if err != nil {
		t.Fatal(err)
	}
	f.wait(t, "the key's absence once the bucket exists", "-")

	write := func(puts map[string][]byte, deletes []string) uint64 {
		t.Helper()
		revs, err := kv.BatchRevisions(ctx, puts, deletes)
		if err != nil {
			t.Fatal(err)
		}
		return revs["node-a"]
	}
	rev := write(map[string][]byte{"node-a": []byte("v1"), "node-b": []byte("x")}, nil)
	if err := b.AnnounceRevision("test.notice.node-a", rev); err != nil {
		t.Fatal(err)
	}
	f.wait(t, "v1 by its notice", "-", "v1")

	// Unannounced: not read. Then a notice of the same revision twice: read once.
	rev = write(map[string][]byte{"node-a": []byte("v2")}, nil)
	rev2 := write(map[string][]byte{"node-a": []byte("v3")}, nil)
	for range 2 {
		if err := b.AnnounceRevision("test.notice.node-a", rev2); err != nil {
			t.Fatal(err)
		}
	}
	f.wait(t, "v3 by its notice, v2 never seen", "-", "v1", "v3")
	if rev2 <= rev {
		t.Fatalf("revisions %d then %d", rev, rev2)
	}

	rev = write(nil, []string{"node-a"})
	if err := b.AnnounceRevision("test.notice.node-a", rev); err != nil {
		t.Fatal(err)
	}
	f.wait(t, "the deletion by its notice", "-", "v1", "v3", "-")
}

// TestFollowKeyReadsAgainAfterAReconnect writes the key without a notice, then restarts the server: the
// reconnection alone (no notice, resync an hour away) makes the follower read the key again.
func TestFollowKeyReadsAgainAfterAReconnect(t *testing.T) {
	r := startRestartable(t)
	b, err := bus.Connect(t.Context(), r.url(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx := t.Context()
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "follow-test"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "node-a", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	var f follower
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- b.FollowKey(fctx, bus.KeyFollowerConfig{Bucket: "follow-test", Key: "node-a", Resync: time.Hour, Retry: 10 * time.Millisecond}, f.fn)
	}()
	t.Cleanup(func() { cancel(); <-done })
	f.wait(t, "v1 at the start", "v1")

	if _, err := kv.Put(ctx, "node-a", []byte("v2")); err != nil {
		t.Fatal(err)
	}
	r.stop()
	r.start()
	f.wait(t, "v2 read after the reconnection", "v1", "v2")
}

// TestFollowKeyNeverGoesBack holds v2, then the bucket is made again with an older revision (what a replica
// catching up also answers), announced: the follower reads again rather than going back, and takes the
// answer only after maxBehind reads in a row. A notice naming a revision the bucket never had does not keep
// it reading for ever: the next write and its notice arrive.
func TestFollowKeyNeverGoesBack(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: "follow-test"})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"v1", "v2"} {
		if _, err := kv.Put(ctx, "node-a", []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	var f follower
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- b.FollowKey(fctx, bus.KeyFollowerConfig{Bucket: "follow-test", Key: "node-a", Notices: "test.notice.node-a",
			Resync: time.Hour, Retry: 50 * time.Millisecond}, f.fn)
	}()
	t.Cleanup(func() { cancel(); <-done })
	f.wait(t, "v2 at the start", "v2")

	// The bucket made again: its only value, "w1", is at revision 1, below the 2 held.
	if err := b.DeleteStream(ctx, "KV_follow-test"); err != nil {
		t.Fatal(err)
	}
	kv, err = b.KV(ctx, bus.KVConfig{Bucket: "follow-test"})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	rev, err := kv.Put(ctx, "node-a", []byte("w1"))
	if err != nil || rev != 1 {
		t.Fatalf("put in the bucket made again: revision %d, %v", rev, err)
	}
	if err := b.AnnounceRevision("test.notice.node-a", rev); err != nil {
		t.Fatal(err)
	}
	f.wait(t, "w1 taken after the reads behind", "v2", "w1")
	// maxBehind reads from 50 ms doubling: 50+100+200+400+800+1600 ms before it is taken.
	if d := time.Since(began); d < time.Second {
		t.Errorf("w1 at revision 1 taken after %s, before the reads behind could be made", d)
	}
	// A notice of a revision far ahead: read again and again, then taken as it is (w1: nothing new).
	if err := b.AnnounceRevision("test.notice.node-a", 1000); err != nil {
		t.Fatal(err)
	}
	rev, err = kv.Put(ctx, "node-a", []byte("w2"))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AnnounceRevision("test.notice.node-a", rev); err != nil {
		t.Fatal(err)
	}
	f.wait(t, "w2 by its notice", "v2", "w1", "w2")
}

// TestBatchRevisionsOfAPartialWrite: when some writes of a batch fail, BatchRevisions says so and still
// returns the revisions of the writes the server took, so that those can be announced.
func TestBatchRevisionsOfAPartialWrite(t *testing.T) {
	srv, b := bustest.Start(t)
	ctx := t.Context()
	_, js := bustest.JetStream(t, srv)
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "partial", MaxValueSize: 16}); err != nil {
		t.Fatal(err)
	}
	kv, err := b.KVExisting(ctx, "partial")
	if err != nil {
		t.Fatal(err)
	}
	revs, err := kv.BatchRevisions(ctx, map[string][]byte{"small": []byte("v"), "large": make([]byte, 64), "other": []byte("w")}, nil)
	if err == nil || !strings.Contains(err.Error(), "large") {
		t.Errorf("err = %v, want the large value's failure", err)
	}
	for _, key := range []string{"small", "other"} {
		_, rev, gerr := kv.Get(ctx, key)
		if gerr != nil || revs[key] != rev {
			t.Errorf("%s: revision returned %d, stored %d (%v)", key, revs[key], rev, gerr)
		}
	}
	if _, ok := revs["large"]; ok {
		t.Errorf("a revision for the write that failed: %v", revs)
	}
}
