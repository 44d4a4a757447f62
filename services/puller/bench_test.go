package puller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// benchPuller runs a puller of testNode over a hollow runtime with the given pull latency.
func benchPuller(b *testing.B, bb *bus.Bus, latency time.Duration, cfg Config) {
	b.Helper()
	rt := hollow.New(hollow.Options{Name: "bench", PullLatency: latency})
	client, stopRT, err := rt.Dial(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	cfg.Node, cfg.Logger, cfg.Registerer = testNode, slog.New(slog.DiscardHandler), prometheus.NewRegistry()
	cfg.RegistryPullQPS = 0
	s, err := New(cfg, client, bb)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	b.Cleanup(func() {
		cancel()
		<-done
		stopRT()
	})
}

// runRequests pushes n pull requests of distinct images through the node's queue, at most window
// outstanding (the queue holds 11 per node), and waits for every result.
func runRequests(b *testing.B, bb *bus.Bus, sub *bus.Subscription, prefix string, n, window int) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	slots := make(chan struct{}, window)
	results := make(chan error, 1)
	go func() {
		seen := 0
		for seen < n {
			_, data, err := sub.Next(ctx)
			if err != nil {
				results <- err
				return
			}
			ev, err := events.DecodeEvent(data)
			if err != nil || ev.Type == events.TypeName(events.EntityPull, events.ActionPulling) {
				continue
			}
			var r events.PullResult
			if err := ev.DecodeData(&r); err != nil || len(r.RequestID) < len(prefix) || r.RequestID[:len(prefix)] != prefix {
				continue
			}
			if r.Error != "" {
				results <- fmt.Errorf("%s: %s %s", r.RequestID, r.Error, r.Message)
				return
			}
			seen++
			<-slots
		}
		results <- nil
	}()
	start := time.Now()
	for i := range n {
		select {
		case slots <- struct{}{}:
		case err := <-results:
			b.Fatalf("after %d requests: %v", i, err)
		}
		id := fmt.Sprintf("%s%d", prefix, i)
		req := events.PullRequest{ID: id, Image: "registry.local/bench/img:" + id, Policy: events.PullAlways}
		// The result is published before the request is acked, so a request whose result came may still
		// hold its place in the queue for a moment: a full queue is retried, as a client would.
		for {
			_, err := Enqueue(ctx, bb, testNode, req)
			if err == nil {
				break
			}
			if !errors.Is(err, ErrPullQueueFull) {
				b.Fatal(err)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if err := <-results; err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkPullTokens: N pulls through the whole path (work queue, puller, CRI over gRPC to the hollow
// runtime with a fixed pull latency), serial and with T tokens, measured in the same run. speedup is
// serial time / parallel time; efficiency is speedup / T (goal >= 0.8).
func BenchmarkPullTokens(b *testing.B) {
	const n, latency = 40, 50 * time.Millisecond
	for _, tokens := range []int{2, 4, 8} {
		b.Run(fmt.Sprintf("tokens=%d", tokens), func(b *testing.B) {
			_, serialBus := bustest.Start(b)
			benchPuller(b, serialBus, latency, Config{})
			_, parBus := bustest.Start(b)
			tk := int32(tokens)
			benchPuller(b, parBus, latency, Config{MaxParallelImagePulls: &tk})
			serialSub, err := serialBus.SubscribeSync(context.Background(), events.EventSubject(testNode, events.EntityPull, "*"))
			if err != nil {
				b.Fatal(err)
			}
			defer serialSub.Close()
			parSub, err := parBus.SubscribeSync(context.Background(), events.EventSubject(testNode, events.EntityPull, "*"))
			if err != nil {
				b.Fatal(err)
			}
			defer parSub.Close()
			var serial, parallel time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				serial += runRequests(b, serialBus, serialSub, fmt.Sprintf("s%d-", i), n, events.MaxPullRequestsPerNode-1)
				parallel += runRequests(b, parBus, parSub, fmt.Sprintf("p%d-", i), n, events.MaxPullRequestsPerNode-1)
			}
			b.StopTimer()
			speedup := float64(serial) / float64(parallel)
			b.ReportMetric(float64(n*b.N)/serial.Seconds(), "serial-pulls/s")
			b.ReportMetric(float64(n*b.N)/parallel.Seconds(), "parallel-pulls/s")
			b.ReportMetric(speedup, "speedup")
			b.ReportMetric(speedup/float64(tokens), "efficiency")
		})
	}
}

// BenchmarkQueueOverhead: requests/s through the puller (work queue, decode, EnsureImageExists with a
// runtime that answers at once, pulling and result events, ack) against raw JetStream publish + durable
// consume + ack on the same server, both with 10 requests outstanding. ratio is puller / raw.
func BenchmarkQueueOverhead(b *testing.B) {
	const n, window = 200, events.MaxPullRequestsPerNode - 1
	_, bb := bustest.Start(b)
	tk := int32(window)
	rt := newFakeImages()
	s, err := newService(Config{Node: testNode, MaxParallelImagePulls: &tk, Logger: slog.New(slog.DiscardHandler),
		BackoffInitial: 10 * time.Second, BackoffMax: 300 * time.Second, AckWait: 30 * time.Second, MaxDeliver: 5,
		DeletedPodMemory: time.Minute, Now: time.Now, CredentialVerificationPolicy: NeverVerifyPreloadedImages}, rt, bb)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	sub, err := bb.SubscribeSync(context.Background(), events.EventSubject(testNode, events.EntityPull, "*"))
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()

	// The raw baseline: a work-queue stream of its own, one durable consumer.
	if err := bb.EnsureStream(context.Background(), bus.StreamConfig{Name: "BENCH_RAW", Subjects: []string{"bench.raw.>"}, WorkQueue: true}); err != nil {
		b.Fatal(err)
	}
	var consumed atomic.Int64
	slots := make(chan struct{}, window)
	rawCtx, rawCancel := context.WithCancel(context.Background())
	rawDone := make(chan error, 1)
	go func() {
		rawDone <- bb.Consume(rawCtx, bus.ConsumerConfig{Stream: "BENCH_RAW", Durable: "raw", MaxAckPending: window},
			func(context.Context, *bus.Msg) error {
				consumed.Add(1)
				<-slots
				return nil
			})
	}()
	defer func() { rawCancel(); <-rawDone }()
	raw := func(prefix string) time.Duration {
		start := time.Now()
		target := consumed.Load() + n
		for i := range n {
			slots <- struct{}{}
			id := fmt.Sprintf("%s%d", prefix, i)
			if _, err := bb.PublishCommand(context.Background(), "bench.raw.x", id, events.PullRequest{ID: id, Image: "busybox"}, nil); err != nil {
				b.Fatal(err)
			}
		}
		for consumed.Load() < target {
			time.Sleep(100 * time.Microsecond)
		}
		return time.Since(start)
	}
	var viaPuller, viaRaw time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		viaRaw += raw(fmt.Sprintf("r%d-", i))
		viaPuller += runRequests(b, bb, sub, fmt.Sprintf("q%d-", i), n, window)
	}
	b.StopTimer()
	pullerRate := float64(n*b.N) / viaPuller.Seconds()
	rawRate := float64(n*b.N) / viaRaw.Seconds()
	b.ReportMetric(pullerRate, "puller-req/s")
	b.ReportMetric(rawRate, "raw-msgs/s")
	b.ReportMetric(pullerRate/rawRate, "ratio")
}
