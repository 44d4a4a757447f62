package integration_test

import (
	"context"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
)

const faultNode = "fault-node"

// faultRuntimeTimeout is the agent's --runtime-request-timeout in the fault loop: no CRI call outlasts it.
const faultRuntimeTimeout = 10 * time.Second

// faultRounds is the number of faults injected: IMAGEFLEET_FAULT_ROUNDS, default 40 (about two and a half
// minutes of faults, so CI stays short); the recorded run in docs/operations.md uses more.
func faultRounds(t *testing.T) int {
	return testenv.Int(t, "IMAGEFLEET_FAULT_ROUNDS")
}

// faultSeed seeds every random choice of the test (which part, when, for how long, what the clients do):
// IMAGEFLEET_FAULT_SEED replays a run; by default it is the clock.
func faultSeed(t *testing.T) uint64 {
	if !testenv.IsSet("IMAGEFLEET_FAULT_SEED") {
		return uint64(time.Now().UnixNano())
	}
	return uint64(testenv.Int(t, "IMAGEFLEET_FAULT_SEED"))
}

// TestFaultInjection kills (SIGKILL) and restarts the NATS server, the node agent and containerd at random
// points, in a bounded loop, while clients add, change and delete pods, run pods with real containers, queue
// pulls and ask for GC passes, retrying each operation until it is acknowledged. Then, with every part up:
//
//   - no pod event lost from the index: the index (`pods get`, `refs`, in-use images) equals a fresh index fed
//     the pod events JetStream acknowledged, and every registration transition is stored exactly once;
//   - no image removed while a container used it: every container the runtime lists has its image (checked
//     after every fault and at the end), and no GC pass removed the image of a pod that was in the index
//     for the whole pass; the pinned sandbox image is never removed;
//   - every pull request ended in exactly one result event;
//   - no side effect done twice, and nothing lost: every event id is stored once, every event the agent
//     journaled is in the stream, and no image was removed twice without a pull between.
//
// The figures (faults by kind, events checked, lost, duplicates) are logged; docs/operations.md "Faults"
// holds a recorded longer run. A failure logs the seed: IMAGEFLEET_FAULT_SEED replays the same choices.
func TestFaultInjection(t *testing.T) {
	began := time.Now()
	rounds, seed := faultRounds(t), faultSeed(t)
	t.Logf("fault loop: %d rounds, seed %d (replay: IMAGEFLEET_FAULT_SEED=%d IMAGEFLEET_FAULT_ROUNDS=%d)", rounds, seed, seed, rounds)
	// Registered first, so it runs last: after the parts' log tails, the seed and the reasons a settle
	// failed are the test's last lines, those a CI report that keeps only the end still shows.
	var settleFailures []string
	t.Cleanup(func() {
		if t.Failed() {
			for _, f := range settleFailures {
				t.Log(f)
			}
			t.Logf("failed with seed %d: IMAGEFLEET_FAULT_SEED=%d IMAGEFLEET_FAULT_ROUNDS=%d go test -count=1 -run TestFaultInjection -v ./integration/",
				seed, seed, rounds)
		}
	})
	rng := rand.New(rand.NewPCG(seed, 1))
	ctx := t.Context()
	bin := imagefleetBinary(t)

	// The registry, a sandbox image and five runnable images (busybox that sleeps, plus some data).
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	push := func(repoTag string, size int64) lab.Pushed {
		p, err := lab.Push(ctx, reg.Host(), repoTag, size, lab.WithBusybox(bb))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	pause := push("fault/pause:1", 0)
	var apps []lab.Pushed
	idOf := map[string]string{}
	for i := range 5 {
		p := push(fmt.Sprintf("fault/app%d:1", i), 256<<10)
		apps = append(apps, p)
		idOf[p.Ref] = p.ID
	}
	ctrd := lab.StartContainerd(t, lab.Options{SandboxImage: pause.Ref, TmpfsSize: "256m"})
	if _, err := ctrd.Client().PullImage(ctx, pause.Ref, nil, nil, nil); err != nil {
		t.Fatalf("pull %s: %v", pause.Ref, err)
	}

	// NATS as its own process, and the agent with short periods so GC, detection and redelivery happen
	// many times in the loop: GC every 2 s removing images unused for 4 s, plus the clients' passes.
	dataDir := t.TempDir()
	w := newFaultWorld(t, bin, faultNode, ctrd, nil)
	w.agentArgs = []string{"agent", "--node", faultNode, "--nats", w.natsURL(), "--cri", ctrd.Endpoint(), "--data-dir", dataDir,
		"--pinned-images", pause.Ref, "--minimum-image-ttl-duration", "0s", "--image-maximum-gc-age", "4s", "--image-gc-period", "2s",
		"--image-detect-period", "2s", "--pull-ack-wait", "5s", "--registry-qps", "0", "--serialize-image-pulls=false",
		"--max-parallel-image-pulls", "3", "--runtime-request-timeout", faultRuntimeTimeout.String(), "--pod-index-flush-interval", "200ms"}
	w.startNATS()
	b, err := bus.Connect(ctx, w.natsURL(), bus.Options{Name: "fault-client", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	bustest.Eventually(t, "the streams", 30*time.Second, func() error {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return b.EnsureStreams(c, bus.StreamsConfig{})
	})
	w.startAgent()
	if err := w.waitAgent(ctx, b, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Logf("set up in %s", time.Since(began).Round(time.Millisecond))
	// Slow registry reads make pulls last long enough to span faults (a pull finishing while NATS is down
	// publishes its result into the journal only).
	reg.SetDelay(250 * time.Millisecond)

	// The loop: the clients run while one part at a time is killed, kept down 0.3-3 s and started again,
	// with 1-3 s between faults.
	wl := newFaultWorkload(ctx, faultNode, b, ctrd.Client(), apps, reg.Ref("fault/missing:1"), seed)
	wl.start()
	loopStart := time.Now()
	var runtimeBad []string
	for range rounds {
		time.Sleep(time.Duration(1000+rng.IntN(2000)) * time.Millisecond)
		kind := faultKinds[rng.IntN(len(faultKinds))]
		w.inject(kind, time.Duration(300+rng.IntN(2700))*time.Millisecond)
		runtimeBad = append(runtimeBad, w.checkRuntime(ctx)...)
	}
	loopTime := time.Since(loopStart)
	w.checkProcs()
	wl.stopClients()
	t.Logf("fault loop done in %s; clients stopped %s later", loopTime.Round(time.Millisecond), (time.Since(loopStart) - loopTime).Round(time.Millisecond))

	// Everything up: let the system finish what it was given.
	if err := w.waitAgent(ctx, b, time.Minute); err != nil {
		t.Fatal(err)
	}
	wl.mu.Lock()
	var lastSeq uint64
	for _, e := range wl.podEvents {
		lastSeq = max(lastSeq, e.seq)
	}
	pullIDs := make([]string, 0, len(wl.pulls))
	for id := range wl.pulls {
		pullIDs = append(pullIDs, id)
	}
	wl.mu.Unlock()
	sort.Strings(pullIDs)
	if err := wl.waitApplied(lastSeq, time.Minute); err != nil {
		t.Errorf("the pod index did not apply the last pod event (seq %d): %v", lastSeq, err)
	}
	settle := func(what string, limit time.Duration, cond func() error) {
		t.Helper()
		deadline := time.Now().Add(limit)
		for {
			w.checkProcs()
			err := cond()
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				d := w.ctrd.Diagnose()
				t.Errorf("%s: not within %s: %v\nthe runtime now: %s", what, limit, err, d)
				first, _, _ := strings.Cut(d, "\n")
				settleFailures = append(settleFailures, fmt.Sprintf("%s: not within %s (the runtime then: %s): %v", what, limit, first, err))
				return
			}
			time.Sleep(250 * time.Millisecond) // polling interval, not an assertion
		}
	}
	settle("a result for every pull request", 2*time.Minute, func() error {
		wl.mu.Lock()
		defer wl.mu.Unlock()
		var missing []string
		for _, id := range pullIDs {
			if _, ok := wl.results[id]; !ok {
				missing = append(missing, id)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%d of %d requests without a result: %v", len(missing), len(pullIDs), missing)
		}
		return nil
	})
	wl.stopWatcher()
	// One more GC pass with every part up: it must succeed and keep the running pods' images.
	settle("a last GC pass", time.Minute, func() error {
		c, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		var res events.GCResult
		if err := b.Request(c, events.CommandSubject(faultNode, events.VerbGC), events.GCRequest{AllUnused: true}, &res); err != nil {
			return err
		}
		if res.Error != "" {
			return fmt.Errorf("gc: %s", res.Error)
		}
		return nil
	})
	// Every event the agent journaled reaches the stream (the journal resends what was pending).
	var stream *faultStream
	var journaled []events.Event
	var torn int
	settle("every journaled event in the stream", time.Minute, func() error {
		var err error
		if journaled, torn, err = readJournal(dataDir); err != nil {
			return err
		}
		c, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if stream, err = readFaultStream(c, b, faultNode); err != nil {
			return err
		}
		n := 0
		for _, ev := range journaled {
			if stream.copies[ev.ID] == 0 {
				n++
			}
		}
		if n > 0 {
			return fmt.Errorf("%d of %d journaled events not stored", n, len(journaled))
		}
		return nil
	})
	if stream == nil {
		t.FailNow()
	}

	// The checks. lost and dups add up every kind of loss and duplicate found.
	lost := map[string]int{"journaled events": 0, "acked pod events": 0, "pods missing from the index": 0, "registration events": 0, "pull results": 0}
	dups := map[string]int{"stored copies of an event id": 0, "pods the index has but should not": 0, "registration events": 0, "pull results": 0, "image removals": 0}
	wl.mu.Lock()
	ledger := slices.Clone(wl.podEvents)
	realPods := slices.Clone(wl.realPods)
	clientErrs := slices.Clone(wl.errs)
	retries := fmt.Sprint(wl.retries)
	gcAsked, gcOK := wl.gcAsked, wl.gcOK
	wl.mu.Unlock()
	for _, e := range clientErrs {
		t.Errorf("client: %s", e)
	}

	// 1. Events: every id stored once; every journaled event and every acked pod event stored.
	dups["stored copies of an event id"] = stream.duplicates()
	for id, n := range stream.copies {
		if n > 1 {
			t.Errorf("event %s stored %d times", id, n)
		}
	}
	whileDown := 0
	for _, ev := range journaled {
		if stream.copies[ev.ID] == 0 {
			lost["journaled events"]++
		}
		if w.whileNATSDown(ev.Time) {
			whileDown++
		}
	}
	for _, e := range ledger {
		if stream.copies[e.id] == 0 {
			lost["acked pod events"]++
			t.Errorf("pod event %s (%s, seq %d) acked but not in the stream", e.id, e.action, e.seq)
		}
	}

	// 2. The pod index equals a fresh index fed the acked pod events.
	expected, wantTrans, err := faultExpected(ledger)
	if err != nil {
		t.Fatal(err)
	}
	var gotPods events.PodsReply
	if err := cliJSON(t, bin, &gotPods, "pods", "get", "--node", faultNode, "--nats", w.natsURL()); err != nil {
		t.Fatal(err)
	}
	pods, err := decodePods(gotPods.Pods)
	if err != nil {
		t.Fatal(err)
	}
	wantPods, _, _ := expected.Index.GetPodsAndMirrorPods()
	missing, extra := diffStrings(describePods(wantPods), describePods(pods))
	lost["pods missing from the index"] = len(missing)
	dups["pods the index has but should not"] = len(extra)
	if len(missing)+len(extra) > 0 {
		t.Errorf("pod index differs from the acked pod events:\nmissing %v\nextra   %v", missing, extra)
	}
	var gotRefs []events.Ref
	if err := cliJSON(t, bin, &gotRefs, "refs", "--node", faultNode, "--nats", w.natsURL()); err != nil {
		t.Fatal(err)
	}
	refStrings := func(refs []events.Ref) []string {
		var out []string
		for _, r := range refs {
			out = append(out, fmt.Sprintf("%s %s/%s %d", r.Kind, r.Namespace, r.Name, r.Count))
		}
		return out
	}
	if missing, extra := diffStrings(refStrings(expected.Refs.Refs()), refStrings(gotRefs)); len(missing)+len(extra) > 0 {
		t.Errorf("refs differ from the acked pod events:\nwant only %v\ngot only  %v", missing, extra)
	}
	var inUse events.InUseReply
	if err := b.Request(ctx, events.QuerySubject(faultNode, events.QryInUse), nil, &inUse); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(inUse.Images, expected.InUseImages()) {
		t.Errorf("in-use images %v, want %v", inUse.Images, expected.InUseImages())
	}
	var gotTrans []string
	for k, n := range stream.transitions {
		for range n {
			gotTrans = append(gotTrans, k)
		}
	}
	var wantTransList []string
	for k, n := range wantTrans {
		for range n {
			wantTransList = append(wantTransList, k)
		}
	}
	missing, extra = diffStrings(wantTransList, gotTrans)
	lost["registration events"] = len(missing)
	dups["registration events"] = len(extra)
	if len(missing)+len(extra) > 0 {
		t.Errorf("registration events differ from the acked pod events (seq kind ns/name registered):\nmissing %v\nextra   %v", missing, extra)
		for _, k := range slices.Concat(missing, extra) {
			var seq uint64
			_, _ = fmt.Sscan(k, &seq)
			var pe []string
			for _, e := range ledger {
				if e.seq == seq {
					pe = append(pe, fmt.Sprintf("%s %s id %s", e.action, e.msg.Subject, e.id))
				}
			}
			t.Logf("%s: stored registration events %v; the acked pod event at that sequence %v", k, stream.transitionEvents[k], pe)
		}
	}

	// 3. Every pull request ended in exactly one result event.
	for _, id := range pullIDs {
		switch n := stream.results[id]; {
		case n == 0:
			lost["pull results"]++
			t.Errorf("pull request %s has no result event", id)
		case n > 1:
			dups["pull results"] += n - 1
			t.Errorf("pull request %s has %d result events", id, n)
		}
	}

	// 4. No image removed while in use, none removed twice, the pinned sandbox image kept.
	runtimeBad = append(runtimeBad, w.checkRuntime(ctx)...)
	for _, v := range runtimeBad {
		t.Errorf("runtime: %s", v)
	}
	removals, gcBad := gcViolations(stream.finished, realPods)
	for _, v := range gcBad {
		t.Errorf("in use: %s", v)
	}
	doubles := doubleRemovals(stream.removed, stream.pulls, idOf, faultRuntimeTimeout)
	dups["image removals"] = len(doubles)
	for _, v := range doubles {
		t.Errorf("side effect twice: %s", v)
	}
	for _, ev := range stream.removed {
		var r events.ImageRemoved
		if ev.DecodeData(&r) == nil && r.ID == pause.ID {
			t.Errorf("the pinned sandbox image %s was removed (event %s)", pause.Ref, ev.ID)
		}
	}
	running := 0
	for _, p := range realPods {
		if p.containerAt.IsZero() || !p.goneAt.IsZero() {
			continue
		}
		running++
		if _, err := ctrd.Client().ImageStatus(ctx, p.image); err != nil {
			t.Errorf("pod %s/%s still runs %s, but the image is gone: %v", p.pod.Namespace, p.pod.Name, p.image, err)
		}
	}
	for _, v := range w.crashes {
		t.Errorf("crash: %s", v)
	}

	// The figures.
	sumOf := func(m map[string]int) int {
		n := 0
		for _, v := range m {
			n += v
		}
		return n
	}
	var kinds []string
	for _, k := range faultKinds {
		kinds = append(kinds, fmt.Sprintf("%s=%d", k, w.faults[k]))
	}
	started, gaveUp := 0, 0
	for _, p := range realPods {
		if !p.containerAt.IsZero() {
			started++
		}
		if p.gaveUp != "" {
			gaveUp++
			t.Logf("pod %d gave up: %s", p.n, p.gaveUp)
		}
	}
	t.Logf("faults injected: %d (%s) in %d rounds over %s; agent exits on error (restarted): %d; containerd exits by itself (restarted): %d; crashes: %d",
		sumOf(w.faults), strings.Join(kinds, " "), rounds, loopTime.Round(time.Second), len(w.agentExits), len(w.ctrdExits), len(w.crashes))
	t.Logf("clients: %d pod events acked, %d pods with containers (%d running at the end, %d gave up), %d pull requests, %d GC passes asked (%d succeeded); retries %s",
		len(ledger), started, running, gaveUp, len(pullIDs), gcAsked, gcOK, retries)
	t.Logf("system: %d images removed by GC in %d passes, %d runtime in-use checks, %d journaled events (%d produced while NATS was down, %d torn lines)",
		removals, len(stream.finished), w.runtimeCheck, len(journaled), whileDown, torn)
	t.Logf("events checked: %d (stream: %d messages); lost: %d %v; duplicates: %d %v; wall time %s",
		len(stream.copies), stream.msgs, sumOf(lost), lost, sumOf(dups), dups, time.Since(began).Round(time.Second))
	for i, e := range w.agentExits {
		t.Logf("agent exit %d:\n%s", i+1, e)
	}
	for i, e := range w.ctrdExits {
		t.Logf("containerd exit %d (by itself), its log:\n%s", i+1, e)
	}
	if sumOf(lost) != 0 || sumOf(dups) != 0 {
		t.Errorf("lost %d, duplicates %d: want 0 and 0", sumOf(lost), sumOf(dups))
	}
	if sumOf(w.faults) != rounds || len(ledger) == 0 || len(pullIDs) == 0 || started == 0 || gcOK == 0 || removals == 0 {
		t.Errorf("the loop proves too little: %d faults, %d pod events, %d pull requests, %d pods started, %d GC passes, %d removals",
			sumOf(w.faults), len(ledger), len(pullIDs), started, gcOK, removals)
	}
}
