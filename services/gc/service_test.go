package gc

import (
	"context"
	"errors"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

func TestConfigValidate(t *testing.T) {
	base := func() Config { return Config{Node: testNode, Policy: DefaultPolicy()} }
	for _, tc := range []struct {
		name    string
		mutate  func(*Config)
		wantErr string
	}{
		{"defaults", func(*Config) {}, ""},
		{"high above 100", func(c *Config) { c.Policy.HighThresholdPercent = 101 },
			"invalid configuration: imageGCHighThresholdPercent (--image-gc-high-threshold) 101 must be between 0 and 100, inclusive"},
		{"low below 0", func(c *Config) { c.Policy.LowThresholdPercent = -1 },
			"invalid configuration: imageGCLowThresholdPercent (--image-gc-low-threshold) -1 must be between 0 and 100, inclusive"},
		{"low equals high", func(c *Config) { c.Policy.LowThresholdPercent = 85 },
			"invalid configuration: imageGCLowThresholdPercent (--image-gc-low-threshold) 85 must be less than imageGCHighThresholdPercent (--image-gc-high-threshold) 85"},
		{"negative min age", func(c *Config) { c.Policy.MinAge = -time.Second },
			"invalid configuration: imageMinimumGCAge -1s must not be negative"},
		{"negative max age", func(c *Config) { c.Policy.MaxAge = -time.Second },
			"invalid configuration: imageMaximumGCAge -1s must not be negative"},
		{"max age not above min age", func(c *Config) { c.Policy.MaxAge = time.Minute },
			"invalid configuration: imageMaximumGCAge 1m0s must be greater than imageMinimumGCAge 2m0s"},
		{"several errors aggregated", func(c *Config) { c.Policy.HighThresholdPercent = 101; c.Policy.MinAge = -time.Second },
			"[invalid configuration: imageGCHighThresholdPercent (--image-gc-high-threshold) 101 must be between 0 and 100, inclusive, invalid configuration: imageMinimumGCAge -1s must not be negative]"},
		{"zero policy", func(c *Config) { c.Policy = Policy{} },
			"invalid configuration: imageGCLowThresholdPercent (--image-gc-low-threshold) 0 must be less than imageGCHighThresholdPercent (--image-gc-high-threshold) 0"},
		{"negative quota", func(c *Config) { c.CapacityBytes = -1 },
			"invalid configuration: imageFsCapacity (--image-fs-capacity) -1 must not be negative"},
		{"negative parallelism", func(c *Config) { c.RemovalParallelism = -2 },
			"invalid configuration: imageGCRemovalParallelism (--image-gc-removal-parallelism) -2 must not be negative"},
		{"bad pinned image", func(c *Config) { c.PinnedImages = []string{"UPPER/Case"} },
			`invalid configuration: pinnedImages (--pinned-images): image "UPPER/Case" is neither a reference nor an image ID`},
		{"bad node", func(c *Config) { c.Node = "Bad_Node" }, `node name "Bad_Node" is not a DNS-1123 subdomain`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base()
			tc.mutate(&c)
			err := c.Validate()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want %q", err, tc.wantErr)
			}
		})
	}
}

// newService builds a Service over the in-memory runtime and records and a real embedded NATS.
func newService(t *testing.T, b *bus.Bus, cfg Config, rt *critest.Runtime, records recordSource, statfs func(string) (int64, int64, error)) *Service {
	t.Helper()
	cfg.Node = testNode
	if cfg.Policy == (Policy{}) {
		cfg.Policy = DefaultPolicy()
	}
	cfg.Registerer = prometheus.NewRegistry()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s, err := New(cfg, Deps{Runtime: rt, Bus: b, Records: records, Statfs: statfs})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func gcSubject() string { return events.CommandSubject(testNode, events.VerbGC) }

// request sends a gc request, retrying until the executor has subscribed.
func request(t *testing.T, b *bus.Bus, body []byte) events.Reply {
	t.Helper()
	var rep events.Reply
	bustest.WaitFor(t, "gc executor to answer", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var err error
		rep, err = b.RequestRaw(ctx, gcSubject(), body)
		return err == nil
	})
	return rep
}

func TestMalformedRequestsGetAnErrorAndServingGoesOn(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100))
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 100, LowThresholdPercent: 80}}, rt, gctest.NewRecords(rt, nil),
		func(string) (int64, int64, error) { return 1000, 900, nil })
	bustest.RunService(t, s)
	for _, tc := range []struct{ name, body, want string }{
		{"bad JSON", `{"dryRun":`, "malformed message: "},
		{"unknown field", `{"dryRun":true,"force":true}`, `unknown field "force"`},
		{"wrong type", `{"highThresholdPercent":"ninety"}`, `field "highThresholdPercent" must be int`},
		{"negative threshold", `{"highThresholdPercent":-5}`, "invalid HighThresholdPercent -5, must be in range [0-100]"},
		{"low above high", `{"highThresholdPercent":50,"lowThresholdPercent":60}`, "LowThresholdPercent 60 can not be higher than HighThresholdPercent 50"},
		{"negative min age", `{"minAge":"-1m"}`, "imageMinimumGCAge -1m0s must not be negative"},
		{"bad duration", `{"maxAge":"soon"}`, `invalid duration "soon"`},
		{"trailing data", `{} {}`, "trailing data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := request(t, b, []byte(tc.body))
			if !strings.Contains(rep.Error, tc.want) || len(rep.Data) != 0 {
				t.Fatalf("reply = %+v, want error containing %q", rep, tc.want)
			}
		})
	}
	// Still serving: a valid dry run answers with a result.
	var res events.GCResult
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := b.Request(ctx, gcSubject(), events.GCRequest{DryRun: true}, &res); err != nil {
		t.Fatal(err)
	}
	if res.Node != testNode || !res.DryRun || res.UsagePercent != 10 {
		t.Fatalf("result = %+v", res)
	}
	if len(rt.Images()) != 1 {
		t.Fatal("a dry run removed an image")
	}
}

func TestGCRequestOverBus(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 200))
	rt.SetContainers(makeContainer(1))
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 100, LowThresholdPercent: 80}}, rt, gctest.NewRecords(rt, nil),
		func(string) (int64, int64, error) { return 1000, 500, nil })
	bustest.RunService(t, s)
	request(t, b, []byte(`{"dryRun":true}`)) // wait until served
	high, low := 50, 0
	var res events.GCResult
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err := b.Request(ctx, gcSubject(), events.GCRequest{HighThresholdPercent: &high, LowThresholdPercent: &low, MinAge: &events.Duration{}}, &res)
	if err != nil {
		t.Fatal(err)
	}
	// usage 50 % >= 50: free down to 0 %: 1000 - 500 = 500; only image-0 (100) is unused.
	if res.UsagePercent != 50 || res.AmountToFree != 500 || res.FreedBytes != 100 || len(res.Removed) != 1 || res.Removed[0].Reason != ReasonSpace {
		t.Fatalf("result = %+v", res)
	}
	if !strings.HasPrefix(res.Error, "Insufficient free disk space on the node's image filesystem (50% of 1000 B used)") {
		t.Errorf("error = %q", res.Error)
	}
	finished := eventsOfType(streamEvents(t, b), events.EntityGC, events.ActionFinished)
	if len(finished) != 2 { // the dry run and this pass
		t.Fatalf("gc.finished events = %d, want 2", len(finished))
	}
	var last events.GCResult
	if err := finished[1].DecodeData(&last); err != nil || last.FreedBytes != 100 || last.Error != res.Error {
		t.Errorf("gc.finished = %+v (%v)", last, err)
	}
}

// failingRecords fails every detection.
type failingRecords struct{ calls atomic.Int64 }

func (f *failingRecords) Detect(context.Context, time.Time) (map[string]events.ImageRecord, error) {
	f.calls.Add(1)
	return nil, errors.New("detect images: no detector")
}

func TestPeriodicFailureWarnsOnSecondConsecutiveFailure(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime()
	recs := &failingRecords{}
	s := newService(t, b, Config{Period: 20 * time.Millisecond}, rt, recs, nil)
	stop := bustest.RunService(t, s)
	bustest.WaitFor(t, "two ImageGCFailed warnings", func() bool {
		return len(eventsOfType(streamEvents(t, b), events.EntityNode, events.ActionWarning)) >= 2
	})
	stop()
	// In stream order: F = a failed pass (gc.finished with an error), W = a warning. The kubelet's loop
	// warns on every failure but the first of a run of failures: F F W F W ... (a pass cut by the
	// shutdown may end the sequence without its warning).
	var seq strings.Builder
	for _, ev := range streamEvents(t, b) {
		switch ev.Type {
		case events.TypeName(events.EntityGC, events.ActionFinished):
			var r events.GCResult
			if err := ev.DecodeData(&r); err != nil || r.Error != "detect images: no detector" {
				t.Fatalf("gc.finished = %+v (%v)", r, err)
			}
			seq.WriteString("F")
		case events.TypeName(events.EntityNode, events.ActionWarning):
			if ev.Reason != EventImageGCFailed || ev.Severity != events.Warning || ev.Message != "detect images: no detector" {
				t.Errorf("warning = %+v", ev)
			}
			seq.WriteString("W")
		}
	}
	if !regexp.MustCompile(`^FFW(FW)*F?$`).MatchString(seq.String()) {
		t.Fatalf("events = %s, want FFW(FW)*", seq.String())
	}
}

// captureHandler records log messages.
type captureHandler struct {
	mu   sync.Mutex
	msgs []string
}

func (h *captureHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *captureHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs = append(h.msgs, r.Message)
	return nil
}
func (h *captureHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *captureHandler) WithGroup(string) slog.Handler      { return h }
func (h *captureHandler) has(msg string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range h.msgs {
		if m == msg {
			return true
		}
	}
	return false
}

func TestDisabledLoopStillServesCommands(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100))
	recs := &countingRecords{Records: gctest.NewRecords(rt, nil)}
	logs := &captureHandler{}
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 100, LowThresholdPercent: 80}, Period: time.Millisecond, Logger: slog.New(logs)},
		rt, recs, func(string) (int64, int64, error) { return 1000, 0, nil })
	bustest.RunService(t, s)
	bustest.WaitFor(t, "the disable line", func() bool {
		return logs.has("ImageGCHighThresholdPercent is set 100 and ImageMaximumGCAge is 0, Disable image GC")
	})
	rep := request(t, b, []byte(`{"dryRun":true}`))
	if rep.Error != "" {
		t.Fatal(rep.Error)
	}
	// With a 1 ms period a running loop would have detected many times by now.
	if n := recs.calls.Load(); n != 1 {
		t.Fatalf("detections = %d, want 1 (the command only)", n)
	}
}

type countingRecords struct {
	*gctest.Records
	calls atomic.Int64
}

func (c *countingRecords) Detect(ctx context.Context, at time.Time) (map[string]events.ImageRecord, error) {
	c.calls.Add(1)
	return c.Records.Detect(ctx, at)
}

func TestRunReturnsAfterCancelWithoutLeaks(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	// The connection starts its async-publish goroutines on the first publish and keeps them until it
	// closes (checked by VerifyNoLeaks after cleanup); publish once so the snapshot below includes them.
	warm, _ := events.New(testNode, events.EntityGC, "warmup", nil)
	if err := b.PublishAll(t.Context(), []events.Event{warm}); err != nil {
		t.Fatal(err)
	}
	// The lease bucket's stream lives in the server until it shuts down: create it before the snapshot.
	if err := EnsureLeaseBucket(t.Context(), b); err != nil {
		t.Fatal(err)
	}
	// The server's own goroutines are not the worker's: some start a moment after the stream that needs them.
	defer goleak.VerifyNone(t, bustest.IgnoreServer(goleak.IgnoreCurrent())...)
	rt := critest.NewRuntime(makeImage(0, 100))
	s := newService(t, b, Config{Period: 10 * time.Millisecond}, rt, gctest.NewRecords(rt, nil),
		func(string) (int64, int64, error) { return 1000, 900, nil })
	stop := bustest.RunService(t, s)
	request(t, b, []byte(`{}`))
	stop()
}

func TestNewNeedsRuntimeAndBus(t *testing.T) {
	if _, err := New(Config{Node: testNode, Policy: DefaultPolicy()}, Deps{}); err == nil {
		t.Fatal("New accepted no runtime and no bus")
	}
	_, err := New(Config{Node: testNode, Policy: DefaultPolicy(), Registerer: prometheus.NewRegistry()},
		Deps{Runtime: critest.NewRuntime(cri.Image{ID: "x"}), Bus: &bus.Bus{}})
	if err != nil {
		t.Fatal(err)
	}
}

// TestRepeatedRequestIDRunsOnePass: a GC request repeated with the same id (a fleet orchestrator asking again
// after its reply was lost) gets the first pass's result and runs no second pass; another id runs its own;
// a request id that is not one is refused.
func TestRepeatedRequestIDRunsOnePass(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 200))
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 100, LowThresholdPercent: 80}}, rt, gctest.NewRecords(rt, nil),
		func(string) (int64, int64, error) { return 1000, 500, nil })
	bustest.RunService(t, s)
	request(t, b, []byte(`{"dryRun":true}`)) // wait until served
	ask := func(req events.GCRequest) events.GCResult {
		t.Helper()
		var res events.GCResult
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		if err := b.Request(ctx, gcSubject(), req, &res); err != nil {
			t.Fatal(err)
		}
		return res
	}
	first := ask(events.GCRequest{ID: "gc-1.node-a", AllUnused: true, MinAge: &events.Duration{}})
	if len(first.Removed) != 2 || first.FreedBytes != 300 || len(rt.Images()) != 0 {
		t.Fatalf("first pass = %+v, %d images left", first, len(rt.Images()))
	}
	rt.SetImages(makeImage(2, 400)) // a second pass would remove it
	again := ask(events.GCRequest{ID: "gc-1.node-a", AllUnused: true, MinAge: &events.Duration{}})
	if again.FreedBytes != 300 || len(again.Removed) != 2 || len(rt.Images()) != 1 {
		t.Fatalf("repeat = %+v, %d images left: want the first result and no second pass", again, len(rt.Images()))
	}
	if n := len(eventsOfType(streamEvents(t, b), events.EntityGC, events.ActionFinished)); n != 2 { // the dry run and one pass
		t.Errorf("gc.finished events = %d, want 2", n)
	}
	other := ask(events.GCRequest{ID: "gc-2.node-a", AllUnused: true, MinAge: &events.Duration{}})
	if other.FreedBytes != 400 || len(rt.Images()) != 0 {
		t.Fatalf("another id = %+v, %d images left: want its own pass", other, len(rt.Images()))
	}
	rep := request(t, b, []byte(`{"id":"no spaces allowed"}`))
	if !strings.Contains(rep.Error, `gc request id "no spaces allowed" must be 1-128 characters`) {
		t.Errorf("bad id: reply %+v", rep)
	}
}
