package bus_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// tailBus starts a server and connects a bus to it through a proxy that can lose its requests, logging to
// logs, with stream T (t.>).
func tailBus(t *testing.T, logs *bustest.SyncBuffer) (*bus.Server, *bustest.Proxy, *bus.Bus) {
	t.Helper()
	srv := bustest.Server(t)
	proxy := bustest.NewProxy(t, srv)
	b, err := bus.Connect(t.Context(), proxy.URL(), bus.Options{Name: t.Name(), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStream(t.Context(), bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	return srv, proxy, b
}

// publishN publishes n messages on t.x.
func publishN(t *testing.T, b *bus.Bus, n int) {
	t.Helper()
	for i := range n {
		raw, _ := json.Marshal(i)
		if _, err := b.PublishCommand(t.Context(), "t.x", "", json.RawMessage(raw), nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReadNoticesALostPull: a reader's pull request lost on its way (a server that went away, one that
// dropped it) is noticed within seconds by its missing heartbeats, counted, logged and sent again, following
// or reading to the end. nats.go's ordered iterator that the reader used before noticed it after two missed
// 5 s heartbeats: the stored message waited 10.0 s.
func TestReadNoticesALostPull(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []bus.ReadOption
	}{
		{"following", []bus.ReadOption{bus.Follow()}},
		{"to the end", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bustest.SyncBuffer
			_, proxy, b := tailBus(t, &logs)
			publishN(t, b, 1)
			before := lostPulls(t, "tail:T", "no_heartbeat")
			lost := proxy.DropNext(1, func(subject string) bool { return strings.HasPrefix(subject, "$JS.API.CONSUMER.MSG.NEXT.T.") })
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			got := make(chan time.Time, 4)
			done := make(chan error, 1)
			go func() {
				done <- b.Read(ctx, "T", "t.>", func(bus.StreamMsg) error {
					got <- time.Now()
					return nil
				}, tc.opts...)
			}()
			var lostAt time.Time
			select {
			case <-lost:
				lostAt = time.Now()
			case <-time.After(time.Minute):
				t.Fatal("Read sent no pull request within a minute")
			}
			select {
			case at := <-got:
				// Two missed heartbeats (2 s) and the time to send the request again; 10 s before.
				if d := at.Sub(lostAt); d > 7*time.Second {
					t.Fatalf("delivered %v after the pull request was lost, want it noticed and sent again within seconds", d.Round(time.Millisecond))
				}
			case <-time.After(time.Minute):
				t.Fatal("nothing delivered within a minute of the pull request lost")
			}
			if n := lostPulls(t, "tail:T", "no_heartbeat") - before; n < 1 {
				t.Errorf("imagefleet_bus_pulls_lost_total{consumer=tail:T,reason=no_heartbeat} rose by %v, want at least 1", n)
			}
			if l := logs.String(); !strings.Contains(l, "pull request lost; pulling anew") || !strings.Contains(l, "reason=no_heartbeat") {
				t.Errorf("no log line of the lost pull request:\n%s", l)
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Read after its context ended (or its one message read): %v, want nil", err)
			}
		})
	}
}

// TestReadGoesOnAfterItsConsumerIsDeleted: a following reader whose consumer is deleted under it (its server lost it, the
// server removed it) makes one anew after the last message it took: the messages come once each, in order.
func TestReadGoesOnAfterItsConsumerIsDeleted(t *testing.T) {
	var logs bustest.SyncBuffer
	srv, _, b := tailBus(t, &logs)
	publishN(t, b, 3)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	seqs := make(chan uint64, 16)
	done := make(chan error, 1)
	go func() {
		done <- b.Read(ctx, "T", "t.>", func(m bus.StreamMsg) error {
			seqs <- m.Seq
			return nil
		}, bus.Follow(), bus.From(2))
	}()
	var got []uint64
	take := func(n int) {
		t.Helper()
		for range n {
			select {
			case s := <-seqs:
				got = append(got, s)
			case <-time.After(30 * time.Second):
				t.Fatalf("Read gave %v, then nothing for 30 s", got)
			}
		}
	}
	take(2)
	// Its consumer, found with a connection of its own.
	_, js := bustest.JetStream(t, srv)
	stream, err := js.Stream(ctx, "T")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for name := range stream.ConsumerNames(ctx).Name() {
		names = append(names, name)
	}
	if len(names) != 1 || !strings.HasPrefix(names[0], "tail_") {
		t.Fatalf("consumers of T: %v, want the reader's one", names)
	}
	if err := js.DeleteConsumer(ctx, "T", names[0]); err != nil {
		t.Fatal(err)
	}
	publishN(t, b, 3)
	take(3)
	if want := []uint64{2, 3, 4, 5, 6}; !slices.Equal(got, want) {
		t.Fatalf("Read from 2 gave %v across its consumer's deletion, want %v", got, want)
	}
	select {
	case s := <-seqs:
		t.Fatalf("Read gave %d more after %v", s, got)
	default:
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Read after its context ended: %v, want nil", err)
	}
}

// readAll reads stream T with opts until Read returns, giving the sequences read and Read's error.
func readAll(t *testing.T, ctx context.Context, b *bus.Bus, filter string, opts ...bus.ReadOption) ([]uint64, error) {
	t.Helper()
	var seqs []uint64
	err := b.Read(ctx, "T", filter, func(m bus.StreamMsg) error {
		seqs = append(seqs, m.Seq)
		return nil
	}, opts...)
	return seqs, err
}

// TestReadToTheEnd: without Follow, Read delivers what the stream holds from its start position and returns
// nil at the end: the stream's last message, the last message of the filter when later ones are others', or
// at once when none is there.
func TestReadToTheEnd(t *testing.T) {
	var logs bustest.SyncBuffer
	_, _, b := tailBus(t, &logs)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if seqs, err := readAll(t, ctx, b, ""); err != nil || len(seqs) != 0 {
		t.Fatalf("Read of an empty stream = %v, %v; want nothing, nil", seqs, err)
	}
	publishN(t, b, 5)
	if _, err := b.PublishCommand(ctx, "t.other", "", json.RawMessage("1"), nil); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		filter string
		opts   []bus.ReadOption
		want   []uint64
	}{
		{"all", "", nil, []uint64{1, 2, 3, 4, 5, 6}},
		{"filtered, others after", "t.x", nil, []uint64{1, 2, 3, 4, 5}},
		{"from", "t.x", []bus.ReadOption{bus.From(3)}, []uint64{3, 4, 5}},
		{"from the last", "", []bus.ReadOption{bus.From(6)}, []uint64{6}},
		{"from past the end", "", []bus.ReadOption{bus.From(7)}, nil},
		{"nothing matches", "t.none", nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seqs, err := readAll(t, ctx, b, tc.filter, tc.opts...)
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			if !slices.Equal(seqs, tc.want) {
				t.Fatalf("Read gave %v, want %v", seqs, tc.want)
			}
		})
	}
}

// TestReadStops: a callback's StopReading ends the read with nil, any other error is returned as is; a read to
// the end that its context cuts short says so, a following one returns nil.
func TestReadStops(t *testing.T) {
	var logs bustest.SyncBuffer
	_, _, b := tailBus(t, &logs)
	publishN(t, b, 5)
	errBoom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		opts    []bus.ReadOption
		ret     error
		wantErr error
	}{
		{"StopReading to the end", nil, bus.StopReading, nil},
		{"StopReading following", []bus.ReadOption{bus.Follow()}, bus.StopReading, nil},
		{"an error to the end", nil, errBoom, errBoom},
		{"an error following", []bus.ReadOption{bus.Follow()}, errBoom, errBoom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var seqs []uint64
			err := b.Read(t.Context(), "T", "", func(m bus.StreamMsg) error {
				seqs = append(seqs, m.Seq)
				if m.Seq == 2 {
					return tc.ret
				}
				return nil
			}, tc.opts...)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("Read = %v, want %v", err, tc.wantErr)
			}
			if !slices.Equal(seqs, []uint64{1, 2}) {
				t.Fatalf("Read gave %v, want [1 2] and no more", seqs)
			}
		})
	}
	for _, tc := range []struct {
		name    string
		opts    []bus.ReadOption
		wantErr error
	}{
		{"context ends reading to the end", nil, context.Canceled},
		{"context ends following", []bus.ReadOption{bus.Follow()}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			err := b.Read(ctx, "T", "", func(m bus.StreamMsg) error {
				if m.Seq == 2 {
					cancel()
				}
				return nil
			}, tc.opts...)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("Read = %v, want %v", err, tc.wantErr)
			}
		})
	}
}

// TestReadFollows: with Follow, Read delivers the stored messages, then those stored after, until its context
// ends; OnStart says first how many it found; From(^uint64(0)) skips those stored before.
func TestReadFollows(t *testing.T) {
	for _, tc := range []struct {
		name        string
		from        uint64
		wantPending uint64
		want        []uint64
	}{
		{"from the first", 0, 3, []uint64{1, 2, 3, 4, 5}},
		{"from 3", 3, 1, []uint64{3, 4, 5}},
		{"new only", ^uint64(0), 0, []uint64{4, 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bustest.SyncBuffer
			_, _, b := tailBus(t, &logs)
			publishN(t, b, 3)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			started := make(chan uint64, 1)
			seqs := make(chan uint64, 16)
			done := make(chan error, 1)
			go func() {
				done <- b.Read(ctx, "T", "t.>", func(m bus.StreamMsg) error {
					seqs <- m.Seq
					return nil
				}, bus.Follow(), bus.From(tc.from), bus.OnStart(func(pending uint64) {
					if n := len(seqs); n > 0 {
						t.Errorf("OnStart called after %d messages", n)
					}
					started <- pending
				}))
			}()
			select {
			case p := <-started:
				if p != tc.wantPending {
					t.Errorf("OnStart(%d), want %d", p, tc.wantPending)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("OnStart not called within 30 s")
			}
			var got []uint64
			take := func(n int) {
				t.Helper()
				for range n {
					select {
					case s := <-seqs:
						got = append(got, s)
					case <-time.After(30 * time.Second):
						t.Fatalf("Read gave %v, then nothing for 30 s", got)
					}
				}
			}
			take(len(tc.want) - 2)
			// Stored after the reader caught up (or, new only, after its consumer was made).
			publishN(t, b, 2)
			take(2)
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Read after its context ended: %v, want nil", err)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("Read gave %v, want %v", got, tc.want)
			}
			select {
			case s := <-seqs:
				t.Fatalf("Read gave %d more after %v", s, got)
			default:
			}
		})
	}
}

// TestReadToTheEndWhenTheRestIsGone: a read to the end whose last messages are removed before their delivery
// (the stream's limits, a purge) still ends: the server's idle heartbeat says nothing is left.
func TestReadToTheEndWhenTheRestIsGone(t *testing.T) {
	var logs bustest.SyncBuffer
	srv, _, b := tailBus(t, &logs)
	publishN(t, b, 3)
	_, js := bustest.JetStream(t, srv)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	seqs, err := readAll(t, ctx, b, "", bus.OnStart(func(pending uint64) {
		if pending != 3 {
			t.Errorf("OnStart(%d), want 3", pending)
		}
		// The consumer counted 3; none is there to deliver.
		s, err := js.Stream(ctx, "T")
		if err == nil {
			err = s.Purge(ctx)
		}
		if err != nil {
			t.Errorf("purge: %v", err)
		}
	}))
	if err != nil {
		t.Fatalf("Read of a stream purged under it: %v, want nil at once", err)
	}
	if len(seqs) != 0 {
		t.Fatalf("Read gave %v of a purged stream", seqs)
	}
}

// TestReadRetryFor: a reader whose consumer cannot be made (its create requests are lost) gives up after
// RetryFor, not when its context ends.
func TestReadRetryFor(t *testing.T) {
	var logs bustest.SyncBuffer
	_, proxy, b := tailBus(t, &logs)
	publishN(t, b, 1)
	proxy.DropNext(1000, func(subject string) bool { return strings.HasPrefix(subject, "$JS.API.CONSUMER.CREATE.T.") })
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	_, err := readAll(t, ctx, b, "t.>", bus.Follow(), bus.RetryFor(time.Second))
	if err == nil || !bus.IsTransient(err) {
		t.Fatalf("Read whose consumer cannot be made = %v, want the transient error", err)
	}
	// One attempt (bus.AttemptTimeout), then no more: the next would start past RetryFor.
	if d := time.Since(start); d > 3*bus.AttemptTimeout {
		t.Fatalf("Read gave up after %v, want about one attempt (%v)", d.Round(time.Millisecond), bus.AttemptTimeout)
	}
	if ctx.Err() != nil {
		t.Fatal("Read returned when its context ended, not after RetryFor")
	}
}

// TestReadCallsBackOnItsCaller: Read runs its callback on the caller's goroutine, as a plain loop would: a
// test's t.Fatal in it (runtime.Goexit) ends the goroutine that called Read, and the reader stops after it,
// leaving no goroutine behind.
func TestReadCallsBackOnItsCaller(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	var logs bustest.SyncBuffer
	_, _, b := tailBus(t, &logs)
	publishN(t, b, 2)
	for _, opts := range [][]bus.ReadOption{nil, {bus.Follow()}} {
		exited := make(chan struct{})
		go func() {
			defer close(exited)
			_ = b.Read(t.Context(), "T", "", func(bus.StreamMsg) error {
				runtime.Goexit()
				return nil
			}, opts...)
			t.Error("Read returned after its callback's Goexit")
		}()
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			t.Fatal("the callback's Goexit did not end the goroutine that called Read: the callback runs on another")
		}
	}
}
