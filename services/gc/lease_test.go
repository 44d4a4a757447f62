package gc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

// replicas builds two GC executors of testNode, each with its own NATS connection (two hosts), over one
// runtime and one detector, as `imagefleet agent --workers gc` on two hosts of one node's runtime.
func replicas(t *testing.T, srv *bus.Server, cfg Config, rt *critest.Runtime) (*Service, *Service, []*prometheus.Registry) {
	t.Helper()
	records := gctest.NewRecords(rt, nil)
	statfs := func(string) (int64, int64, error) {
		// 100 B per image on a 2000 B filesystem.
		return 2000, 2000 - 100*int64(len(rt.Images())), nil
	}
	var regs []*prometheus.Registry
	mk := func() *Service {
		c := cfg
		c.Node, c.Policy = testNode, Policy{HighThresholdPercent: 50, LowThresholdPercent: 10}
		reg := prometheus.NewRegistry()
		regs = append(regs, reg)
		c.Registerer, c.Logger = reg, slog.New(slog.DiscardHandler)
		s, err := New(c, Deps{Runtime: rt, Bus: bustest.Connect(t, srv), Records: records, Statfs: statfs})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	return mk(), mk(), regs
}

func images(n int) []cri.Image {
	out := make([]cri.Image, n)
	for i := range out {
		out[i] = makeImage(i, 100)
	}
	return out
}

func leaseCount(reg *prometheus.Registry, trigger, outcome string) float64 {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "imagefleet_gc_lease_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var tr, oc string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "trigger":
					tr = l.GetValue()
				case "outcome":
					oc = l.GetValue()
				}
			}
			if tr == trigger && oc == outcome {
				return m.GetCounter().GetValue()
			}
		}
	}
	return -1
}

// TestLeaseReplicasNeverOverlap: two executors of one node, triggered at once by every trigger (manual,
// pull, usage, periodic) in several rounds, never run overlapping passes (the gc.finished results' start and
// end), and no image is removed twice.
func TestLeaseReplicasNeverOverlap(t *testing.T) {
	srv, b := bustest.Start(t)
	rt := critest.NewRuntime()
	var mu sync.Mutex
	removals := map[string]int{}
	rt.OnRemove(func(id string) {
		time.Sleep(5 * time.Millisecond) // a removal takes time: passes last long enough to collide
		mu.Lock()
		removals[id]++
		mu.Unlock()
	})
	s1, s2, regs := replicas(t, srv, Config{RemovalParallelism: 1}, rt)
	const rounds = 4
	for round := range rounds {
		imgs := images(20)
		for i := range imgs {
			imgs[i].ID = imgs[i].ID + "-r" + string(rune('a'+round))
		}
		rt.SetImages(imgs...)
		var wg sync.WaitGroup
		run := func(f func()) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				f()
			}()
		}
		manual := func(s *Service, allUnused bool) func() {
			return func() { _, _ = s.GarbageCollect(t.Context(), events.GCRequest{AllUnused: allUnused}) }
		}
		pull := func(s *Service) func() {
			return func() { _, _ = s.GarbageCollect(t.Context(), events.GCRequest{Trigger: events.GCTriggerPull}) }
		}
		timed := func(s *Service, trigger string) func() {
			return func() { _, _ = s.garbageCollect(t.Context(), events.GCRequest{}, trigger) }
		}
		if round == 0 {
			// One collision made rather than hoped for: while s1's pass holds the lease at its first
			// removal, s2's timed triggers skip and its pull-triggered request waits. The other triggers
			// then race as in the later rounds.
			gate := rt.GateRemovals()
			run(manual(s1, true))
			bustest.WaitFor(t, "s1's pass to remove", func() bool { now, _ := rt.InFlight(); return now > 0 })
			for _, tr := range []string{events.GCTriggerPeriodic, events.GCTriggerUsage} {
				if _, err := s2.garbageCollect(t.Context(), events.GCRequest{}, tr); !errors.Is(err, errLeaseHeld) {
					t.Errorf("%s pass on s2 while s1's pass holds the lease: err %v, want errLeaseHeld", tr, err)
				}
			}
			run(pull(s2))
			bustest.WaitFor(t, "s2's pull-triggered request to wait", func() bool {
				return testutil.ToFloat64(s2.leaseMetrics.waiting.WithLabelValues(events.GCTriggerPull)) == 1
			})
			for _, f := range []func(){manual(s2, false), pull(s1), timed(s1, events.GCTriggerUsage), timed(s1, events.GCTriggerPeriodic)} {
				run(f)
			}
			close(gate)
			wg.Wait()
			continue
		}
		for i, s := range []*Service{s1, s2} {
			run(manual(s, i == 0))
			run(pull(s))
			run(timed(s, events.GCTriggerUsage))
			run(timed(s, events.GCTriggerPeriodic))
		}
		wg.Wait()
	}
	var passes []events.GCResult
	for _, ev := range eventsOfType(streamEvents(t, b), events.EntityGC, events.ActionFinished) {
		var r events.GCResult
		if err := ev.DecodeData(&r); err != nil {
			t.Fatal(err)
		}
		passes = append(passes, r)
	}
	slices.SortFunc(passes, func(a, b events.GCResult) int { return a.Started.Compare(b.Started) })
	for i := 1; i < len(passes); i++ {
		prevEnd := passes[i-1].Started.Add(passes[i-1].Duration.Duration)
		if passes[i].Started.Before(prevEnd) {
			t.Errorf("pass %d (%s, started %s) overlaps pass %d (%s, %s..%s)", i, passes[i].Trigger,
				passes[i].Started.Format(time.StampMicro), i-1, passes[i-1].Trigger,
				passes[i-1].Started.Format(time.StampMicro), prevEnd.Format(time.StampMicro))
		}
	}
	mu.Lock()
	for id, n := range removals {
		if n != 1 {
			t.Errorf("image %s removed %d times", id, n)
		}
	}
	if len(removals) < rounds*18 { // every round frees down to 10 %: at least 18 of 20 images
		t.Errorf("%d removals over %d rounds, want at least %d", len(removals), rounds, rounds*18)
	}
	mu.Unlock()
	var acquired, shared, skipped float64
	for _, reg := range regs {
		for _, tr := range []string{events.GCTriggerManual, events.GCTriggerPull, events.GCTriggerUsage, events.GCTriggerPeriodic} {
			acquired += leaseCount(reg, tr, leaseAcquired) + leaseCount(reg, tr, leaseWaited)
			shared += leaseCount(reg, tr, leaseShared)
			skipped += leaseCount(reg, tr, leaseSkipped)
		}
		if n := leaseCount(reg, events.GCTriggerManual, leaseUnavailable); n != 0 {
			t.Errorf("lease unavailable %v times", n)
		}
	}
	if int(acquired) != len(passes) {
		t.Errorf("%v passes took the lease, %d gc.finished: every pass holds it", acquired, len(passes))
	}
	t.Logf("%d rounds: %d passes, %v requests shared another replica's pass, %v timed triggers skipped", rounds, len(passes), shared, skipped)
	if skipped < 2 {
		t.Errorf("%v timed triggers skipped, want at least the 2 of the first round's collision", skipped)
	}
}

// TestLeaseWaiterSharesTheRunningPass: a pull-triggered request on the second replica while the first
// replica's pass runs waits for it and answers with its result (one pass, one gc.finished); a periodic pass
// meanwhile skips; a request with policy overrides runs its own pass after.
func TestLeaseWaiterSharesTheRunningPass(t *testing.T) {
	srv, b := bustest.Start(t)
	rt := critest.NewRuntime(images(4)...)
	s1, s2, regs := replicas(t, srv, Config{}, rt)
	gate := rt.GateRemovals()
	first := make(chan events.GCResult, 1)
	go func() {
		res, _ := s1.GarbageCollect(t.Context(), events.GCRequest{AllUnused: true})
		first <- res
	}()
	bustest.WaitFor(t, "the first pass to remove", func() bool { now, _ := rt.InFlight(); return now > 0 })
	if _, err := s2.garbageCollect(t.Context(), events.GCRequest{}, events.GCTriggerPeriodic); !errors.Is(err, errLeaseHeld) {
		t.Errorf("periodic pass while the other replica holds the lease: err %v, want errLeaseHeld", err)
	}
	second := make(chan events.GCResult, 1)
	go func() {
		res, _ := s2.GarbageCollect(t.Context(), events.GCRequest{Trigger: events.GCTriggerPull})
		second <- res
	}()
	bustest.WaitFor(t, "the pull-triggered request to wait", func() bool {
		return testutil.ToFloat64(s2.leaseMetrics.waiting.WithLabelValues(events.GCTriggerPull)) == 1
	})
	select {
	case <-second:
		t.Fatal("the pull-triggered request answered while the other pass runs")
	default:
	}
	close(gate)
	r1, r2 := <-first, <-second
	if !r1.Started.Equal(r2.Started) || len(r2.Removed) != 4 || r2.Trigger != events.GCTriggerManual {
		t.Errorf("shared answer %+v, want the first pass's result %+v", r2, r1)
	}
	if n := leaseCount(regs[1], events.GCTriggerPull, leaseShared); n != 1 {
		t.Errorf("shared = %v, want 1", n)
	}
	if n := leaseCount(regs[1], events.GCTriggerPeriodic, leaseSkipped); n != 1 {
		t.Errorf("skipped = %v, want 1", n)
	}
	if n := len(eventsOfType(streamEvents(t, b), events.EntityGC, events.ActionFinished)); n != 1 {
		t.Errorf("gc.finished = %d, want 1 (one pass)", n)
	}
	// Overrides: not shared, its own pass.
	rt.SetImages(images(2)...)
	gate2 := rt.GateRemovals()
	go func() {
		res, _ := s1.GarbageCollect(t.Context(), events.GCRequest{AllUnused: true})
		first <- res
	}()
	bustest.WaitFor(t, "the first pass to remove", func() bool { now, _ := rt.InFlight(); return now > 0 })
	high := 0
	go func() {
		res, _ := s2.GarbageCollect(t.Context(), events.GCRequest{HighThresholdPercent: &high, LowThresholdPercent: &high, MinAge: &events.Duration{}})
		second <- res
	}()
	bustest.WaitFor(t, "the request with overrides to wait", func() bool {
		return testutil.ToFloat64(s2.leaseMetrics.waiting.WithLabelValues(events.GCTriggerManual)) == 1
	})
	close(gate2)
	r1, r2 = <-first, <-second
	if r1.Started.Equal(r2.Started) || r2.Trigger != events.GCTriggerManual {
		t.Errorf("request with overrides answered with another pass: %+v", r2)
	}
	if n := leaseCount(regs[1], events.GCTriggerManual, leaseWaited); n != 1 {
		t.Errorf("waited = %v, want 1", n)
	}
}

// TestLeaseOfADeadHolderExpires: a holder that died (its key written, never renewed nor released) blocks
// the node's passes no longer than the lease's TTL; a request that cannot wait that long gets the clear
// error over the bus.
func TestLeaseOfADeadHolderExpires(t *testing.T) {
	srv, b := bustest.Start(t)
	const ttl = time.Second
	rt := critest.NewRuntime(images(3)...)
	s1, _, regs := replicas(t, srv, Config{LeaseTTL: ttl, LeaseWait: 300 * time.Millisecond}, rt)
	dead := newLeaser(b, testNode, ttl, slog.New(slog.DiscardHandler))
	dead.holder = "dead-host/1/ffff"
	took := time.Now()
	if _, held, err := dead.acquire(t.Context(), leaseValue{Pass: "p-dead", Holder: dead.holder, Trigger: events.GCTriggerManual, Started: took.UTC()}); err != nil || held != nil {
		t.Fatalf("dead holder's acquire: held %v err %v", held, err)
	}
	// Over the bus, a manual request with LeaseWait 300ms: the clear error.
	bustest.RunService(t, s1)
	rep := request(t, b, []byte(`{}`))
	want := "a GC pass is already running on node " + testNode + " (held by dead-host/1/ffff, manual pass started "
	if !strings.HasPrefix(rep.Error, want) || len(rt.Images()) != 3 {
		t.Fatalf("reply %+v, want an error starting %q and no removal", rep, want)
	}
	if n := leaseCount(regs[0], events.GCTriggerManual, leaseTimeout); n != 1 {
		t.Errorf("timeout = %v, want 1", n)
	}
	// Waiting longer than the TTL: the pass runs once the dead holder's key expires.
	s1.cfg.LeaseWait = 10 * time.Second
	res, err := s1.GarbageCollect(t.Context(), events.GCRequest{AllUnused: true})
	elapsed := time.Since(took)
	if err != nil || len(res.Succeeded()) != 3 {
		t.Fatalf("pass after the dead holder: %+v, %v", res, err)
	}
	t.Logf("pass ran %v after the dead holder took the lease (TTL %v)", elapsed.Round(time.Millisecond), ttl)
	if elapsed > ttl+2*time.Second {
		t.Errorf("the dead holder blocked the pass for %v, TTL %v", elapsed, ttl)
	}
	if n := leaseCount(regs[0], events.GCTriggerManual, leaseWaited); n != 1 {
		t.Errorf("waited = %v, want 1", n)
	}
	// Released with the result: the next pass takes it at once.
	if _, held, err := dead.acquire(context.Background(), leaseValue{Pass: "p-next", Holder: dead.holder, Started: time.Now()}); err != nil || held != nil {
		t.Errorf("after the release: held %+v err %v", held, err)
	}
}

// TestLeaseMetricsExportedAtZero: every trigger and outcome of imagefleet_gc_lease_total is exported at 0.
func TestLeaseMetricsExportedAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := newLeaseMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "imagefleet_gc_lease_total"); n != 4*len(leaseOutcomes) {
		t.Errorf("%d series, want %d", n, 4*len(leaseOutcomes))
	}
}

// TestLeaseOfADeadProcessOnThisHostIsTakenAtOnce: a replica restarted after SIGKILL (the holder is a process
// of this host and pid namespace that no longer runs) takes the lease at once; a holder process that still
// runs here is respected.
func TestLeaseOfADeadProcessOnThisHostIsTakenAtOnce(t *testing.T) {
	srv, b := bustest.Start(t)
	rt := critest.NewRuntime(images(3)...)
	s1, _, regs := replicas(t, srv, Config{LeaseWait: 200 * time.Millisecond}, rt)
	other := newLeaser(b, testNode, DefaultLeaseTTL, slog.New(slog.DiscardHandler))

	alive := exec.Command("sleep", "30")
	if err := alive.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = alive.Process.Kill(); _ = alive.Wait() })
	other.holder = fmt.Sprintf("%s/%d/alive", processSpace(), alive.Process.Pid)
	if _, held, err := other.acquire(t.Context(), leaseValue{Pass: "p-alive", Holder: other.holder, Started: time.Now()}); err != nil || held != nil {
		t.Fatalf("acquire: held %v err %v", held, err)
	}
	if _, err := s1.garbageCollect(t.Context(), events.GCRequest{}, events.GCTriggerPeriodic); !errors.Is(err, errLeaseHeld) {
		t.Fatalf("a running holder on this host: err %v, want errLeaseHeld", err)
	}
	_ = alive.Process.Kill()
	_ = alive.Wait() // reaped: its pid no longer runs
	start := time.Now()
	res, err := s1.GarbageCollect(t.Context(), events.GCRequest{AllUnused: true})
	if err != nil || len(res.Succeeded()) != 3 {
		t.Fatalf("pass after the holder died: %+v, %v", res, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the dead holder on this host blocked the pass for %v", d)
	}
	if n := leaseCount(regs[0], events.GCTriggerManual, leaseAcquired); n != 1 {
		t.Errorf("acquired = %v, want 1 (taken over without waiting)", n)
	}
}

// TestLeaseReleaseOfALargeResult: a result too large for the lease value is released without its kept images
// (the removed ones stay), so waiting requests still share it.
func TestLeaseReleaseOfALargeResult(t *testing.T) {
	_, b := bustest.Start(t)
	l := newLeaser(b, testNode, DefaultLeaseTTL, slog.New(slog.DiscardHandler))
	v := leaseValue{Pass: "p-large", Holder: l.holder, Trigger: events.GCTriggerManual, Started: time.Now()}
	rev, held, err := l.acquire(t.Context(), v)
	if err != nil || held != nil {
		t.Fatalf("acquire: held %v err %v", held, err)
	}
	res := events.GCResult{Node: testNode, Removed: []events.GCRemoved{{ID: "sha256:removed"}}}
	for i := range 10000 {
		res.Skipped = append(res.Skipped, events.GCSkipped{ID: fmt.Sprintf("sha256:%064d", i), Why: WhyInUse})
	}
	l.release(t.Context(), rev, v, res)
	got, _, err := l.get(t.Context(), l.kv)
	if err != nil || !got.Released || got.Result == nil {
		t.Fatalf("after release: %+v %v", got, err)
	}
	if len(got.Result.Skipped) != 0 || len(got.Result.Removed) != 1 || got.Result.Removed[0].ID != "sha256:removed" {
		t.Errorf("released result: %d skipped, removed %+v; want no skipped, the removed image", len(got.Result.Skipped), got.Result.Removed)
	}
}

// TestLeaseBucketOpensWithOneLookup: with the default TTL, the bucket `imagefleet bus init` made is opened
// with one stream info request (bus.KV reads the status as well: two per node on the first leased pass);
// a missing bucket is still created.
func TestLeaseBucketOpensWithOneLookup(t *testing.T) {
	_, b := bustest.Start(t)
	sub, err := b.SubscribeSync(t.Context(), "$JS.API.>")
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	fresh := newLeaser(b, testNode, DefaultLeaseTTL, slog.New(slog.DiscardHandler))
	if _, err := fresh.open(t.Context()); err != nil {
		t.Fatalf("open with no bucket: %v", err)
	}
	created := false
	for _, s := range apiRequests(t, sub) {
		created = created || strings.HasPrefix(s, "$JS.API.STREAM.CREATE.KV_"+events.GCLeaseBucket)
	}
	if !created {
		t.Fatal("the missing lease bucket was not created")
	}
	l := newLeaser(b, testNode, DefaultLeaseTTL, slog.New(slog.DiscardHandler))
	if _, err := l.open(t.Context()); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range apiRequests(t, sub) {
		if strings.Contains(s, "KV_"+events.GCLeaseBucket) {
			got = append(got, s)
		}
	}
	if len(got) != 1 || !strings.HasPrefix(got[0], "$JS.API.STREAM.INFO.") {
		t.Errorf("opening the existing lease bucket asked %q; want one stream info", got)
	}
}

// TestLeaseBucketOpenedAtStart: a running executor opens the lease bucket when it starts, so its first
// leased pass makes no stream lookup of its own (a fleet GC soon after the fleet's agents started would
// otherwise make one per node inside the rollout, on the bucket's stream leader).
func TestLeaseBucketOpenedAtStart(t *testing.T) {
	_, b := bustest.Start(t)
	if err := EnsureLeaseBucket(t.Context(), b); err != nil {
		t.Fatal(err)
	}
	api, err := b.SubscribeSync(t.Context(), "$JS.API.>")
	if err != nil {
		t.Fatal(err)
	}
	defer api.Close()
	leaseWrites, err := b.SubscribeSync(t.Context(), "$KV."+events.GCLeaseBucket+".>")
	if err != nil {
		t.Fatal(err)
	}
	defer leaseWrites.Close()
	rt := critest.NewRuntime(makeImage(0, 100), makeImage(1, 100))
	statfs := func(string) (int64, int64, error) { return 2000, 2000 - 100*int64(len(rt.Images())), nil }
	s := newService(t, b, Config{Policy: Policy{HighThresholdPercent: 50, LowThresholdPercent: 10}}, rt, gctest.NewRecords(rt, nil), statfs)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	lookup := "$JS.API.STREAM.INFO.KV_" + events.GCLeaseBucket
	// The lookup made at start, before any pass.
	sctx, scancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer scancel()
	for {
		subject, _, err := api.Next(sctx)
		if err != nil {
			t.Fatalf("no %s at start: %v", lookup, err)
		}
		if subject == lookup {
			break
		}
	}
	// The lookup's answer stored: the request seen above may still wait for it.
	bustest.WaitFor(t, "the lease bucket opened at start", func() bool {
		s.lease.mu.Lock()
		defer s.lease.mu.Unlock()
		return s.lease.kv != nil
	})
	res, err := s.GarbageCollect(t.Context(), events.GCRequest{AllUnused: true})
	if err != nil || len(res.Removed) != 2 {
		t.Fatalf("pass: removed %v, err %v; want both images", res.Removed, err)
	}
	// The pass ran under the lease: it took it and released it.
	wctx, wcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer wcancel()
	if _, _, err := leaseWrites.Next(wctx); err != nil {
		t.Fatalf("the pass wrote no lease: %v", err)
	}
	// Everything the pass sent on the connection reached the subscription before this marker.
	marker := "$JS.API.TEST.MARKER"
	if err := b.PublishRaw(marker, nil); err != nil {
		t.Fatal(err)
	}
	for {
		subject, _, err := api.Next(wctx)
		if err != nil {
			t.Fatalf("marker not seen: %v", err)
		}
		if subject == marker {
			break
		}
		if strings.Contains(subject, "KV_"+events.GCLeaseBucket) && !strings.HasPrefix(subject, "$JS.API.DIRECT.GET.") {
			t.Errorf("the first leased pass asked %s; want no lookup of the lease bucket after start", subject)
		}
	}
}
