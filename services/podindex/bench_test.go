package podindex

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testenv"
)

// An IMAGEFLEET_* variable no test reads (a mistyped knob) stops the run before any test: docs/testing.md.
func init() { testenv.MustCheck() }

// benchPods is the number of distinct pods the benchmark events cycle through.
const benchPods = 10000

// benchPod is pod k of the benchmark: 3 secrets (an image pull secret, an envFrom secret, a secret volume)
// and 2 configmaps (an env var, a configmap volume), from small shared pools.
func benchPod(k, round int) *v1.Pod {
	return &v1.Pod{
		TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: fmt.Sprintf("ns-%d", k%20), Name: fmt.Sprintf("pod-%d", k),
			UID: types.UID(fmt.Sprintf("uid-%d", k)), Labels: map[string]string{"round": fmt.Sprint(round)}},
		Spec: v1.PodSpec{
			ImagePullSecrets: []v1.LocalObjectReference{{Name: fmt.Sprintf("pull-%d", k%7)}},
			Containers: []v1.Container{{
				Name: "app", Image: fmt.Sprintf("registry.example/app-%d:1.%d", k%50, round),
				EnvFrom: []v1.EnvFromSource{{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("env-%d", k%31)}}}},
				Env: []v1.EnvVar{{Name: "CFG", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{
					LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cfg-%d", k%13)}, Key: "k"}}}},
			}},
			Volumes: []v1.Volume{
				{Name: "tls", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: fmt.Sprintf("tls-%d", k%17)}}},
				{Name: "conf", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("conf-%d", k%11)}}}},
			},
		},
		Status: v1.PodStatus{Phase: v1.PodRunning},
	}
}

// benchAction is the action of event i: each pod is added, updated, then deleted, round after round.
func benchAction(i int) string {
	switch (i / benchPods) % 3 {
	case 0:
		return events.ActionAdded
	case 1:
		return events.ActionUpdated
	default:
		return events.ActionDeleted
	}
}

func benchMsgs(b *testing.B, node string, n int) []bus.RawMsg {
	b.Helper()
	msgs := make([]bus.RawMsg, n)
	at := time.Now()
	for i := range msgs {
		m, err := PodEventMsg(node, benchAction(i), benchPod(i%benchPods, i/benchPods), "", at)
		if err != nil {
			b.Fatal(err)
		}
		msgs[i] = m
	}
	return msgs
}

// publishAll publishes msgs as a producer does: asynchronously, pipelined (bus.PublishMsgs keeps up to 1024
// acks outstanding), waiting for the acks only at the end. It returns the last sequence.
func publishAll(b *testing.B, bb *bus.Bus, msgs []bus.RawMsg) uint64 {
	b.Helper()
	last, err := bb.PublishMsgs(context.Background(), msgs)
	if err != nil {
		b.Fatal(err)
	}
	return last
}

// cpuTime is the user and system CPU time of the process so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// startPhaseProfile writes a CPU profile of the end-to-end phase alone (not the set-up or the raw phase) to
// the file named by IMAGEFLEET_BENCH_CPUPROFILE, when it is set; it returns the function that stops it.
func startPhaseProfile(b *testing.B) func() {
	path := testenv.String(b, "IMAGEFLEET_BENCH_CPUPROFILE")
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEndToEnd publishes pod events to a real embedded nats-server and waits until the pod index applied
// the last one; the raw figure is the same messages published to another subject of the same stream, with
// no consumer, in the same run (before), and the tail figure the same messages again, published to a third
// subject and read back by an ordered consumer that does nothing with them (after: publish and consume, no
// pod index). Each phase starts after a garbage collection.
func BenchmarkEndToEnd(b *testing.B) {
	for _, n := range []int{10000, 100000} {
		b.Run(fmt.Sprintf("events=%d", n), func(b *testing.B) {
			var rawRate, tailRate, e2eRate, rawCPU, tailCPU, e2eCPU, kvWrites, e2eAllocs, e2eBytes float64
			for range b.N {
				b.StopTimer()
				srv, bb := bustest.Start(b)
				sb := bustest.Connect(b, srv) // the index has its own connection, as in its own process
				msgs := benchMsgs(b, "bench-node", n)
				raw, tailed := make([]bus.RawMsg, n), make([]bus.RawMsg, n)
				for i, m := range msgs {
					m.Subject = events.EventSubject("bench-raw", events.EntityPod, "raw")
					m.MsgID = "raw-" + m.MsgID
					raw[i] = m
					m.Subject = events.EventSubject("bench-tail", events.EntityPod, msgs[i].Subject[strings.LastIndexByte(msgs[i].Subject, '.')+1:])
					m.MsgID = "tail-" + msgs[i].MsgID
					tailed[i] = m
				}
				s, err := New(Config{Node: "bench-node", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, sb)
				if err != nil {
					b.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- s.Run(ctx) }()
				<-s.Ready()
				b.StartTimer()

				start, cpu := time.Now(), cpuTime(b)
				publishAll(b, bb, raw)
				rawRate = float64(n) / time.Since(start).Seconds()
				rawCPU = (cpuTime(b) - cpu).Seconds() * 1e6 / float64(n)

				b.StopTimer()
				runtime.GC() // each phase starts with no garbage of the one before
				b.StartTimer()
				stopProfile := startPhaseProfile(b)
				var m0, m1 runtime.MemStats
				runtime.ReadMemStats(&m0)
				start, cpu = time.Now(), cpuTime(b)
				last := publishAll(b, bb, msgs)
				waitSeq(b, "the index", s.State().Applied, last, done)
				e2eRate = float64(n) / time.Since(start).Seconds()
				e2eCPU = (cpuTime(b) - cpu).Seconds() * 1e6 / float64(n)
				runtime.ReadMemStats(&m1)
				e2eAllocs = float64(m1.Mallocs-m0.Mallocs) / float64(n)
				e2eBytes = float64(m1.TotalAlloc-m0.TotalAlloc) / float64(n)
				stopProfile()

				b.StopTimer()
				cancel()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				kv, err := bb.Stream(context.Background(), "KV_"+snapshotBucket)
				if err != nil {
					b.Fatal(err)
				}
				kvWrites = float64(kv.LastSeq)
				if p, m := s.State().Index.size(); n%(3*benchPods) == 0 && p+m != 0 {
					b.Fatalf("%d pods left after whole add/update/delete rounds", p+m)
				}

				// Publish and tail, after the end-to-end phase (which so runs second, as before this phase
				// was added): the same messages read back by an ordered consumer on the index's connection
				// that only counts them: the floor of the end-to-end phase in this run, before any decoding
				// or applying. A first message puts the consumer in place before the clock starts.
				runtime.GC()
				tailCtx, tailStop := context.WithCancel(context.Background())
				var tailedSeq atomic.Uint64
				tailDone := make(chan error, 1)
				go func() {
					tailDone <- sb.Read(tailCtx, events.EventsStream, events.PodEventSubjects("bench-tail"), func(m bus.StreamMsg) error {
						tailedSeq.Store(m.Seq)
						return nil
					}, bus.Follow())
				}()
				warm := tailed[0]
				warm.MsgID = "warm-" + warm.MsgID
				waitSeq(b, "the tail's first message", tailedSeq.Load, publishAll(b, bb, []bus.RawMsg{warm}), tailDone)
				b.StartTimer()
				start, cpu = time.Now(), cpuTime(b)
				waitSeq(b, "the tail", tailedSeq.Load, publishAll(b, bb, tailed), tailDone)
				tailRate = float64(n) / time.Since(start).Seconds()
				tailCPU = (cpuTime(b) - cpu).Seconds() * 1e6 / float64(n)
				b.StopTimer()
				tailStop()
				if err := <-tailDone; err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(e2eRate, "events/s")
			b.ReportMetric(rawRate, "raw-events/s")
			b.ReportMetric(e2eRate/rawRate*100, "%-of-raw")
			b.ReportMetric(tailRate, "tail-events/s")
			b.ReportMetric(e2eRate/tailRate*100, "%-of-tail")
			// The process's CPU time (server, producer and index together) per event: steadier than the rates
			// on a shared machine.
			b.ReportMetric(e2eCPU, "cpu-µs/event")
			b.ReportMetric(rawCPU, "raw-cpu-µs/event")
			b.ReportMetric(tailCPU, "tail-cpu-µs/event")
			// The process's allocations per event in the end-to-end phase (server, producer and index).
			b.ReportMetric(e2eAllocs, "allocs/event")
			b.ReportMetric(e2eBytes, "B/event")
			// Snapshot records written (pods, deletions, applied sequences) per event, final flush included.
			b.ReportMetric(kvWrites/float64(n), "snapshot-writes/event")
		})
	}
}

// waitSeq waits until cur() reaches seq; it fails the benchmark if the reader behind cur ends first (errc) or
// after 5 minutes.
func waitSeq(b *testing.B, what string, cur func() uint64, seq uint64, errc <-chan error) {
	b.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	for cur() < seq {
		select {
		case err := <-errc:
			b.Fatalf("%s ended at %d of %d: %v", what, cur(), seq, err)
		case <-time.After(time.Millisecond):
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s at %d of %d after 5 minutes", what, cur(), seq)
		}
	}
}

// BenchmarkApply is the in-process apply alone (index, registration with its reference counts, dirty
// tracking and the snapshot records a flush takes every 50,000 events) of decoded events: 10,000 pods, each
// added, updated (same references, new image) then deleted; one op is that whole cycle of 30,000 events, so a
// run of -benchtime 1x measures 30,000 of them. A first cycle before the timer grows the maps to their
// steady size (as on a node that has been running). Per-event time and allocations are reported.
//
// "decoded" applies the events as DecodePodEvent gives them, with what depends on the pod alone (its
// secret and configmap names, full name, mirror and terminal flags) worked out by the decoders, which run in
// parallel ahead of the applier; "unprepared" leaves that to Apply, as for events built in process: the
// difference is the work the decoders took off the one goroutine that applies events in order.
func BenchmarkApply(b *testing.B) {
	for _, prepared := range []bool{true, false} {
		name := "decoded"
		if !prepared {
			name = "unprepared"
		}
		b.Run(name, func(b *testing.B) { benchmarkApply(b, prepared) })
	}
}

func benchmarkApply(b *testing.B, prepared bool) {
	const n = 3 * benchPods
	evs := make([]PodEvent, n)
	for i := range evs {
		p := benchPod(i%benchPods, i/benchPods)
		raw, err := json.Marshal(p) // the service keeps the body it received
		if err != nil {
			b.Fatal(err)
		}
		evs[i] = PodEvent{Action: benchAction(i), Pod: p, Raw: raw}
		if prepared && evs[i].Action != events.ActionDeleted {
			evs[i].prep.set(p)
		}
	}
	s := NewState()
	var seq uint64
	transitions := 0
	cycle := func() {
		for i := range evs {
			seq++
			transitions += len(s.Apply(seq, evs[i]))
			if seq%50000 == 0 {
				// As the periodic flush does: take the changes and encode their records (the writer encodes
				// them outside the lock Apply takes, but the work is counted here all the same).
				d, err := s.takeDirty()
				if err != nil {
					b.Fatal(err)
				}
				for _, r := range d.Puts {
					if _, err := r.Encode(); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
	}
	cycle()
	if p, m := s.Index.size(); p+m != 0 || len(s.Refs.Refs()) != 0 || transitions == 0 {
		b.Fatalf("a whole cycle left %d pods and %d referenced objects (%d transitions)", p+m, len(s.Refs.Refs()), transitions)
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		cycle()
	}
	elapsed := time.Since(start)
	b.StopTimer()
	runtime.ReadMemStats(&after)
	total := float64(b.N * n)
	b.ReportMetric(total/elapsed.Seconds(), "events/s")
	b.ReportMetric(float64(elapsed.Nanoseconds())/total, "ns/event")
	b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/total, "B/event")
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/total, "allocs/event")
}

// BenchmarkDecode is the pod event decoder alone (JSON of a pod with 3 secrets and 2 configmaps).
func BenchmarkDecode(b *testing.B) {
	m, err := PodEventMsg("bench-node", events.ActionAdded, benchPod(1, 0), "", time.Now())
	if err != nil {
		b.Fatal(err)
	}
	h := map[string][]string{events.HeaderType: {m.Header[events.HeaderType]}}
	b.SetBytes(int64(len(m.Data)))
	b.ReportAllocs()
	for range b.N {
		if _, err := DecodePodEvent(m.Subject, h, m.Data); err != nil {
			b.Fatal(err)
		}
	}
}
