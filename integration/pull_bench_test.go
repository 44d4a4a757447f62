package integration_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/puller"
)

// BenchmarkPullRealRegistry: N pulls into a real containerd from a loopback registry that holds every
// manifest and blob read for a fixed delay, serial and with T tokens, in the same run (each iteration
// pulls fresh tags). speedup is serial time / parallel time, efficiency speedup / T.
func BenchmarkPullRealRegistry(b *testing.B) {
	const n, tokens, delay = 6, 3, 150 * time.Millisecond
	reg := lab.StartRegistry(b, lab.RegistryOptions{})
	ctrd := lab.StartContainerd(b, lab.Options{TmpfsSize: "256m"})
	push := func(prefix string) []string {
		var refs []string
		for i := range n {
			p, err := lab.Push(b.Context(), reg.Host(), fmt.Sprintf("bench/%s%d:1", prefix, i), 32<<10)
			if err != nil {
				b.Fatal(err)
			}
			refs = append(refs, p.Ref)
		}
		return refs
	}
	run := func(bb *bus.Bus, sub *bus.Subscription, refs []string, prefix string) time.Duration {
		var ids []string
		start := time.Now()
		for i, ref := range refs {
			id := fmt.Sprintf("%s-%d", prefix, i)
			ids = append(ids, id)
			pullPublish(b, bb, events.PullRequest{ID: id, Image: ref, Policy: events.PullAlways})
		}
		for id, o := range pullResults(b, sub, 5*time.Minute, ids...) {
			if o.r.Error != "" {
				b.Fatalf("%s: %s", id, o.r.Message)
			}
		}
		return time.Since(start)
	}
	_, serialBus := bustest.Start(b)
	pullStartPuller(b, serialBus, ctrd.Client(), puller.Config{})
	_, parBus := bustest.Start(b)
	tk := int32(tokens)
	pullStartPuller(b, parBus, ctrd.Client(), puller.Config{MaxParallelImagePulls: &tk})
	serialSub, parSub := pullSubscribe(b, serialBus), pullSubscribe(b, parBus)
	var serial, parallel time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		sRefs, pRefs := push(fmt.Sprintf("s%d-", i)), push(fmt.Sprintf("p%d-", i))
		reg.SetDelay(delay)
		b.StartTimer()
		serial += run(serialBus, serialSub, sRefs, fmt.Sprintf("s%d", i))
		parallel += run(parBus, parSub, pRefs, fmt.Sprintf("p%d", i))
		b.StopTimer()
		reg.SetDelay(0)
		b.StartTimer()
	}
	b.StopTimer()
	speedup := float64(serial) / float64(parallel)
	b.ReportMetric(float64(n*b.N)/serial.Seconds(), "serial-pulls/s")
	b.ReportMetric(float64(n*b.N)/parallel.Seconds(), "parallel-pulls/s")
	b.ReportMetric(speedup, "speedup")
	b.ReportMetric(speedup/tokens, "efficiency")
}
