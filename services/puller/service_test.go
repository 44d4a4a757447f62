package puller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

const testNode = "node-a.example"

// startService runs a puller of testNode on b over rt until the test ends; stop stops it and waits.
func startService(t *testing.T, b *bus.Bus, rt imageService, cfg Config) (s *Service, stop func()) {
	t.Helper()
	cfg.Node = testNode
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	s, err := newService(cfg, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	return s, bustest.RunService(t, s)
}

func subscribePull(t *testing.T, b *bus.Bus) *bus.Subscription {
	t.Helper()
	sub, err := b.SubscribeSync(t.Context(), events.EventSubject(testNode, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return sub
}

// nextPullEvent reads the next pull event from sub and decodes its result; err is the wait's (ctx ended).
func nextPullEvent(t *testing.T, ctx context.Context, sub *bus.Subscription) (events.Event, events.PullResult, error) {
	t.Helper()
	subj, data, err := sub.Next(ctx)
	if err != nil {
		return events.Event{}, events.PullResult{}, err
	}
	ev, err := events.DecodeEvent(data)
	if err != nil {
		t.Fatalf("event on %s: %v", subj, err)
	}
	var r events.PullResult
	if err := ev.DecodeData(&r); err != nil {
		t.Fatal(err)
	}
	return ev, r, nil
}

// nextResult waits for the terminal event of request id, returning the events seen for it on the way.
func nextResult(t *testing.T, sub *bus.Subscription, id string, timeout time.Duration) (events.Event, events.PullResult, []events.Event) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	var seen []events.Event
	for {
		ev, r, err := nextPullEvent(t, ctx, sub)
		if err != nil {
			t.Fatalf("waiting for the result of %s: %v (seen %d events)", id, err, len(seen))
		}
		if r.RequestID != id {
			continue
		}
		seen = append(seen, ev)
		if ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
			return ev, r, seen
		}
	}
}

// collectResults waits for the terminal results of every id, in whatever order they come.
func collectResults(t *testing.T, sub *bus.Subscription, ids []string, timeout time.Duration) map[string]events.PullResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := map[string]events.PullResult{}
	for len(out) < len(want) {
		ev, r, err := nextPullEvent(t, ctx, sub)
		if err != nil {
			t.Fatalf("waiting for results: %v (have %d of %d)", err, len(out), len(want))
		}
		if want[r.RequestID] && ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
			if _, dup := out[r.RequestID]; dup {
				t.Errorf("two results for %s", r.RequestID)
			}
			out[r.RequestID] = r
		}
	}
	return out
}

func publishPull(t *testing.T, b *bus.Bus, req events.PullRequest) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	_, err := Enqueue(ctx, b, testNode, req)
	return err
}

func TestServicePullEvents(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages("present_image:latest")
	startService(t, b, rt, Config{})
	sub := subscribePull(t, b)
	pod := &events.PodRef{Namespace: "test-ns", Name: "web", UID: "uid-1"}

	for _, c := range []struct {
		name, image, policy   string
		action, reason, kind  string
		severity, message     string
		resultMsg             string
		pullingEvent, present bool
	}{
		{name: "missing image pulled", image: "missing_image", policy: events.PullIfNotPresent, action: events.ActionPulled,
			reason: "Pulled", severity: events.Normal, message: `Successfully pulled image "missing_image" in `, pullingEvent: true},
		{name: "present image", image: "present_image", policy: events.PullIfNotPresent, action: events.ActionPulled, reason: "Pulled",
			severity: events.Normal, message: `Container image "present_image" already present on machine and can be accessed by the pod`, present: true},
		{name: "never and missing", image: "other_image", policy: events.PullNever, action: events.ActionFailed, reason: "ErrImageNeverPull",
			severity: events.Warning, kind: events.ErrKindImageNeverPull, message: `Container image "other_image" is not present with pull policy of Never`,
			resultMsg: `Container image "other_image" is not present with pull policy of Never`},
		{name: "invalid name", image: "FAILED_IMAGE", policy: events.PullAlways, action: events.ActionFailed, reason: "InspectFailed",
			severity: events.Warning, kind: events.ErrKindInvalidImageName, message: `Failed to apply default image tag "FAILED_IMAGE"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			id := strings.ReplaceAll(c.name, " ", "-")
			if err := publishPull(t, b, events.PullRequest{ID: id, Image: c.image, Policy: c.policy, Pod: pod}); err != nil {
				t.Fatal(err)
			}
			ev, r, seen := nextResult(t, sub, id, 10*time.Second)
			if ev.Type != events.TypeName(events.EntityPull, c.action) || ev.Reason != c.reason || ev.Severity != c.severity ||
				!strings.HasPrefix(ev.Message, c.message) {
				t.Errorf("result event %s %s %s %q", ev.Type, ev.Severity, ev.Reason, ev.Message)
			}
			if ev.ID != events.PullResultEventID(id) {
				t.Errorf("result event id %s, want the derived %s", ev.ID, events.PullResultEventID(id))
			}
			if ev.Object == nil || ev.Object.Kind != "Pod" || ev.Object.UID != "uid-1" || ev.Object.Namespace != "test-ns" {
				t.Errorf("event object %+v", ev.Object)
			}
			if r.Error != c.kind || (c.resultMsg != "" && r.Message != c.resultMsg) {
				t.Errorf("result error %q message %q", r.Error, r.Message)
			}
			if c.kind == "" && r.ImageRef == "" {
				t.Errorf("success without imageRef: %+v", r)
			}
			if got := len(seen) == 2; got != c.pullingEvent {
				t.Errorf("saw %d events, pulling event expected %v", len(seen), c.pullingEvent)
			}
			if c.pullingEvent && (seen[0].Reason != "Pulling" || seen[0].Message != fmt.Sprintf("Pulling image %q", c.image)) {
				t.Errorf("pulling event %+v", seen[0])
			}
		})
	}
}

// TestSerialQueueFull: serial mode holds one pull and ten waiting requests; the next publish is refused at
// once with ErrPullQueueFull (the kubelet's 11th caller blocks, W-G); once the queue drains it accepts again.
func TestSerialQueueFull(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	startService(t, b, rt, Config{})
	sub := subscribePull(t, b)
	for i := range events.MaxPullRequestsPerNode {
		if err := publishPull(t, b, events.PullRequest{ID: fmt.Sprintf("r%d", i), Image: fmt.Sprintf("img%d", i), Policy: events.PullAlways}); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	bustest.WaitFor(t, "the first pull", func() bool { return rt.inFlight.Load() == 1 })
	start := time.Now()
	err := publishPull(t, b, events.PullRequest{ID: "r-over", Image: "img-over", Policy: events.PullAlways})
	if !errors.Is(err, ErrPullQueueFull) {
		t.Fatalf("12th request: %v, want ErrPullQueueFull", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("refusal took %v, want at once", d)
	}
	// A retried publish of a stored request is de-duplicated, not refused.
	if err := publishPull(t, b, events.PullRequest{ID: "r3", Image: "img3", Policy: events.PullAlways}); err != nil {
		t.Errorf("duplicate publish: %v", err)
	}
	for range events.MaxPullRequestsPerNode {
		rt.release <- nil
	}
	var ids []string
	for i := range events.MaxPullRequestsPerNode {
		ids = append(ids, fmt.Sprintf("r%d", i))
	}
	for id, r := range collectResults(t, sub, ids, 10*time.Second) {
		if r.Error != "" {
			t.Errorf("%s: %s %s", id, r.Error, r.Message)
		}
	}
	if got := rt.maxInFlight.Load(); got != 1 {
		t.Errorf("serial mode ran %d pulls at once", got)
	}
	if rt.pulls.Load() != events.MaxPullRequestsPerNode {
		t.Errorf("%d pulls for %d requests (a duplicate was pulled?)", rt.pulls.Load(), events.MaxPullRequestsPerNode)
	}
	rt.block = false
	if err := publishPull(t, b, events.PullRequest{ID: "r-after", Image: "img-after", Policy: events.PullAlways}); err != nil {
		t.Fatalf("after draining: %v", err)
	}
	nextResult(t, sub, "r-after", 10*time.Second)
}

// TestTokensAcrossReplicas: --max-parallel-image-pulls 2 with two replicas of the node's puller: never
// more than 2 pulls in flight, because the server enforces MaxAckPending on the shared durable consumer.
func TestTokensAcrossReplicas(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	cfg := Config{MaxParallelImagePulls: ptr(int32(2)), Registerer: prometheus.NewRegistry()}
	s1, _ := startService(t, b, rt, cfg)
	cfg.Registerer = prometheus.NewRegistry()
	s2, _ := startService(t, b, rt, cfg)
	sub := subscribePull(t, b)
	const n = 8
	for i := range n {
		if err := publishPull(t, b, events.PullRequest{ID: fmt.Sprintf("p%d", i), Image: fmt.Sprintf("img%d", i), Policy: events.PullAlways}); err != nil {
			t.Fatal(err)
		}
	}
	bustest.WaitFor(t, "two pulls", func() bool { return rt.inFlight.Load() == 2 })
	// Give a third pull every chance to start if the limit were per replica.
	time.Sleep(300 * time.Millisecond)
	if got := rt.inFlight.Load(); got != 2 {
		t.Fatalf("%d pulls in flight, want 2", got)
	}
	st, err := b.Consumer(t.Context(), events.PullStreamOf(testNode), events.PullerDurable(testNode))
	if err != nil {
		t.Fatal(err)
	}
	if st.MaxAckPending != 2 || st.NumAckPending != 2 {
		t.Errorf("consumer %+v, want max ack pending 2 with 2 pending", st)
	}
	for range n {
		rt.release <- nil
	}
	var ids []string
	for i := range n {
		ids = append(ids, fmt.Sprintf("p%d", i))
	}
	for id, r := range collectResults(t, sub, ids, 10*time.Second) {
		if r.Error != "" {
			t.Errorf("%s: %s", id, r.Message)
		}
	}
	if got := rt.maxInFlight.Load(); got != 2 {
		t.Errorf("max in flight %d, want 2", got)
	}
	bustest.WaitFor(t, "no request in flight", func() bool { return s1.InFlight()+s2.InFlight() == 0 })
}

// TestRequestSurvivesRestart: a puller stopped in the middle of a pull hands the request back; the next
// puller completes it, once.
func TestRequestSurvivesRestart(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	_, stop1 := startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "survivor", Image: "img", Policy: events.PullIfNotPresent}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the pull", func() bool { return rt.inFlight.Load() == 1 })
	stop1()
	if rt.inFlight.Load() != 0 {
		t.Fatal("the stopped puller left its runtime pull running")
	}
	rt.block = false
	startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	ev, r, _ := nextResult(t, sub, "survivor", 10*time.Second)
	if r.Error != "" || r.Deliveries != 2 || ev.Reason != "Pulled" {
		t.Fatalf("result after restart: %+v %s", r, ev.Reason)
	}
	// Publishing the same result again (a puller that died between publish and ack) is dropped.
	s3, err := newService(Config{Node: testNode, Logger: slog.New(slog.DiscardHandler), BackoffInitial: time.Second, BackoffMax: time.Minute, Now: time.Now}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	if err := s3.publishResult(t.Context(), events.PullRequest{ID: "survivor"}, r, KubeEvent{Severity: events.Normal, Reason: "Pulled", Message: "dup"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	n := 0
	err = b.Read(t.Context(), events.EventsStream, events.EventSubject(testNode, events.EntityPull, events.ActionPulled), func(m bus.StreamMsg) error {
		n++
		return nil
	})
	if err != nil || n != 1 {
		t.Fatalf("stored results %d (%v), want 1", n, err)
	}
}

// TestPodDeletedCancelsPull (#88662): a pod.deleted event cancels the pod's pull in the runtime and its
// queued requests are answered as cancelled without a runtime call.
func TestPodDeletedCancelsPull(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	s, _ := startService(t, b, rt, Config{MaxParallelImagePulls: ptr(int32(4))})
	sub := subscribePull(t, b)
	pod := &events.PodRef{Namespace: "ns", Name: "doomed", UID: "uid-doomed"}
	if err := publishPull(t, b, events.PullRequest{ID: "c1", Image: "big", Policy: events.PullAlways, Pod: pod}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the pull", func() bool { return rt.inFlight.Load() == 1 })
	podJSON, _ := json.Marshal(map[string]any{"metadata": map[string]any{"uid": "uid-doomed", "name": "doomed", "namespace": "ns"}})
	if err := b.PublishRaw(events.EventSubject(testNode, events.EntityPod, events.ActionDeleted), podJSON); err != nil {
		t.Fatal(err)
	}
	ev, r, _ := nextResult(t, sub, "c1", 10*time.Second)
	if !r.Cancelled || r.Error != events.ErrKindImagePull || ev.Reason != "Failed" || !strings.Contains(r.Message, "pod deleted") {
		t.Fatalf("cancelled result %+v (%s %q)", r, ev.Reason, ev.Message)
	}
	bustest.WaitFor(t, "the runtime pull to stop", func() bool { return rt.inFlight.Load() == 0 })
	pulls := rt.pulls.Load()
	if err := publishPull(t, b, events.PullRequest{ID: "c2", Image: "big", Policy: events.PullAlways, Pod: pod}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "c2", 10*time.Second); !r.Cancelled {
		t.Fatalf("request of a deleted pod: %+v", r)
	}
	if rt.pulls.Load() != pulls {
		t.Error("a deleted pod's request reached the runtime")
	}
	// An explicit cancellation of one request.
	other := &events.PodRef{Namespace: "ns", Name: "alive", UID: "uid-alive"}
	if err := publishPull(t, b, events.PullRequest{ID: "c3", Image: "big2", Policy: events.PullAlways, Pod: other}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the pull", func() bool { return rt.inFlight.Load() == 1 })
	cancelJSON, _ := json.Marshal(events.PullCancel{RequestID: "c3"})
	if err := b.PublishRaw(events.CommandSubject(testNode, events.VerbPullCancel), cancelJSON); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "c3", 10*time.Second); !r.Cancelled || !strings.Contains(r.Message, "cancelled on request") {
		t.Fatalf("explicit cancellation: %+v", r)
	}
	// A request withdrawn while it waits in the queue is answered without a runtime call.
	pulls = rt.pulls.Load()
	cancelJSON, _ = json.Marshal(events.PullCancel{RequestID: "c4"})
	if err := b.PublishRaw(events.CommandSubject(testNode, events.VerbPullCancel), cancelJSON); err != nil {
		t.Fatal(err)
	}
	// Core NATS: the cancellation must reach the puller before the request.
	bustest.WaitFor(t, "the puller to record c4 as withdrawn", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		_, ok := s.withdrawn["c4"]
		return ok
	})
	if err := publishPull(t, b, events.PullRequest{ID: "c4", Image: "big3", Policy: events.PullAlways, Pod: other}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "c4", 10*time.Second); !r.Cancelled || !strings.Contains(r.Message, "request c4: cancelled on request") {
		t.Fatalf("withdrawn request: %+v", r)
	}
	if rt.pulls.Load() != pulls {
		t.Error("a withdrawn request reached the runtime")
	}
}

// TestMalformedRequests: bodies that can never be processed are terminated as dead letters with the reason
// and counted; the puller goes on.
func TestMalformedRequests(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	reg := prometheus.NewRegistry()
	startService(t, b, rt, Config{Registerer: reg})
	sub := subscribePull(t, b)
	subject := events.PullSubject(testNode)
	bodies := []any{
		map[string]any{"id": "m1", "image": "busybox", "policy": "Sometimes"},
		map[string]any{"id": "m2", "image": "busybox", "unknown": 1},
		map[string]any{"id": "", "image": "busybox"},
		[]int{1, 2},
		map[string]any{"id": "m5", "image": "busybox", "secrets": []string{"s"}},
	}
	for i, body := range bodies {
		if _, err := b.PublishCommand(t.Context(), subject, fmt.Sprintf("bad-%d", i), body, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := publishPull(t, b, events.PullRequest{ID: "good", Image: "busybox", Policy: events.PullAlways}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "good", 10*time.Second); r.Error != "" {
		t.Fatalf("good request after bad ones: %+v", r)
	}
	var dl []bus.DeadLetter
	bustest.WaitFor(t, "dead letters", func() bool {
		var err error
		dl, err = b.DeadLetters(t.Context(), "")
		return err == nil && len(dl) == len(bodies)
	})
	for _, d := range dl {
		if !strings.Contains(d.Reason, "malformed message") || d.Subject != subject {
			t.Errorf("dead letter %+v", d)
		}
	}
	if got := testutil.ToFloat64(mustCounter(t, reg, "imagefleet_puller_malformed_requests_total")); got != float64(len(bodies)) {
		t.Errorf("malformed counter %v, want %d", got, len(bodies))
	}
}

func mustCounter(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			c := prometheus.NewCounter(prometheus.CounterOpts{Name: name})
			c.Add(mf.GetMetric()[0].GetCounter().GetValue())
			return c
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

// TestBackoffSurvivesRestart: backoff lives in the KV bucket, so a restarted puller still backs off (the
// kubelet forgets, #119891 is the other side of it).
func TestBackoffSurvivesRestart(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.err = errors.New("404 not found")
	pod := &events.PodRef{Namespace: "ns", Name: "p", UID: "uid-b"}
	_, stop := startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "b1", Image: "typo", Policy: events.PullIfNotPresent, Pod: pod}); err != nil {
		t.Fatal(err)
	}
	if _, r, _ := nextResult(t, sub, "b1", 10*time.Second); r.Error != events.ErrKindImagePull {
		t.Fatalf("first: %+v", r)
	}
	stop()
	startService(t, b, rt, Config{Registerer: prometheus.NewRegistry()})
	if err := publishPull(t, b, events.PullRequest{ID: "b2", Image: "typo", Policy: events.PullIfNotPresent, Pod: pod}); err != nil {
		t.Fatal(err)
	}
	ev, r, _ := nextResult(t, sub, "b2", 10*time.Second)
	if r.Error != events.ErrKindImagePullBackOff || r.Message != `Back-off pulling image "typo": ErrImagePull: 404 not found` ||
		ev.Reason != "BackOff" || ev.Severity != events.Normal {
		t.Fatalf("after restart: %+v %s %s", r, ev.Severity, ev.Reason)
	}
	if rt.pulls.Load() != 1 {
		t.Errorf("%d runtime pulls, want 1", rt.pulls.Load())
	}
}

// TestKilledPullerRedelivered: a puller whose connection dies in the middle of a pull (a crash, as far as
// the server can tell) stops signalling progress; after AckWait the request goes to another replica, which
// completes it once.
func TestKilledPullerRedelivered(t *testing.T) {
	srv := bustest.Server(t)
	b := bustest.Connect(t, srv)
	b1 := bustest.Connect(t, srv)
	rt1 := newFakeImages()
	rt1.block = true
	ackWait := time.Second
	startService(t, b1, rt1, Config{AckWait: ackWait, Registerer: prometheus.NewRegistry()})
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "crash", Image: "img", Policy: events.PullAlways}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the first pull", func() bool { return rt1.inFlight.Load() == 1 })
	b1.Close() // the first puller is gone for the server: no ack, no progress
	rt2 := newFakeImages()
	startService(t, b, rt2, Config{AckWait: ackWait, Registerer: prometheus.NewRegistry()})
	start := time.Now()
	_, r, _ := nextResult(t, sub, "crash", 30*time.Second)
	if r.Error != "" || r.Deliveries != 2 {
		t.Fatalf("redelivered result %+v", r)
	}
	if d := time.Since(start); d < ackWait/2 {
		t.Errorf("redelivered after %v, before AckWait %v", d, ackWait)
	}
	if rt2.pulls.Load() != 1 {
		t.Errorf("second puller pulled %d times", rt2.pulls.Load())
	}
	rt1.release <- errors.New("too late")
}

// TestLongPullNotRedelivered: a pull longer than AckWait is kept by its puller (progress signals), not
// handed to another replica.
func TestLongPullNotRedelivered(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages()
	rt.block = true
	cfg := Config{AckWait: 600 * time.Millisecond, MaxParallelImagePulls: ptr(int32(2))}
	cfg.Registerer = prometheus.NewRegistry()
	startService(t, b, rt, cfg)
	cfg.Registerer = prometheus.NewRegistry()
	startService(t, b, rt, cfg)
	sub := subscribePull(t, b)
	if err := publishPull(t, b, events.PullRequest{ID: "long", Image: "img", Policy: events.PullAlways}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the pull", func() bool { return rt.inFlight.Load() == 1 })
	time.Sleep(2 * time.Second) // over three AckWaits
	if got := rt.pulls.Load(); got != 1 {
		t.Fatalf("%d runtime pulls during one long request: it was redelivered", got)
	}
	rt.release <- nil
	if _, r, _ := nextResult(t, sub, "long", 10*time.Second); r.Error != "" || r.Deliveries != 1 {
		t.Fatalf("result %+v", r)
	}
}
