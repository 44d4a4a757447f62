package integration_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
)

// BenchmarkGCBetweenPeriods measures, on the lab (containerd 1.6 on a 128 MiB tmpfs, thresholds 60/40,
// the default 10 s check period, the 5-minute period out of reach), the time from the image filesystem
// crossing the high threshold to the end of the GC pass, and the bytes the pass gave back beyond what the
// low threshold needed. The disk is filled with 10 MiB images pulled straight over CRI (no pull events), so
// only the periodic usage check can notice. The baseline, in the same run, is what the kubelet's rule would
// have removed on the same pass (CRI-declared sizes until amountToFree), measured in disk bytes per image;
// the kubelet's time would be up to its 5-minute period.
//
//	go test ./integration/ -run '^$' -bench BenchmarkGCBetweenPeriods -benchtime=1x -count=3
func BenchmarkGCBetweenPeriods(b *testing.B) {
	for i := 0; i < b.N; i++ {
		benchOnePass(b, fmt.Sprintf("bench-disk-%d", i))
	}
}

func benchOnePass(b *testing.B, node string) {
	l := startDiskLabWith(b, node, "128m", 60, 40, false, 0)
	ctx := context.Background()
	cl := l.ctrd.Client()
	capacity, _, _ := gcUsage(b, l.mount)
	target := capacity * int64(100-l.low) / 100
	var crossed time.Time
	for j := 0; crossed.IsZero(); j++ {
		if j > 8 {
			b.Fatal("usage never reached the high threshold")
		}
		p, err := lab.Push(ctx, l.reg.Host(), fmt.Sprintf("bench/fill-%d:1", j), 10*gcMiB)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := cl.PullImage(ctx, p.Ref, nil, nil, nil); err != nil {
			b.Fatalf("pull %s: %v", p.Ref, err)
		}
		if _, _, usage := gcUsage(b, l.mount); usage >= l.high {
			crossed = time.Now()
		}
	}
	var res events.GCResult
	bustest.Eventually(b, "a GC pass after crossing the high threshold", time.Minute, func() error {
		passes := l.passes(b)
		if len(passes) == 0 {
			return errors.New("no pass yet")
		}
		res = passes[0]
		return nil
	})
	end := res.Started.Add(res.Duration.Duration)
	ok := res.Succeeded()
	if res.Error != "" || len(ok) == 0 || res.Trigger != events.GCTriggerUsage {
		b.Fatalf("pass: trigger %q, removed %d, error %q", res.Trigger, len(ok), res.Error)
	}
	perImage := res.MeasuredFreedBytes / int64(len(ok))
	beyond := res.MeasuredAvailableBytes - target
	// The kubelet's rule on the same pass: CRI-declared sizes, oldest first, until amountToFree.
	var declared int64
	kubelet := 0
	for _, rm := range ok {
		if declared >= res.AmountToFree {
			break
		}
		declared += rm.Size
		kubelet++
	}
	for declared < res.AmountToFree { // the kubelet would have gone on to images this pass kept
		declared += ok[0].Size
		kubelet++
	}
	kubeletBeyond := res.AvailableBytes + int64(kubelet)*perImage - target
	b.ReportMetric(end.Sub(crossed).Seconds(), "s-cross-to-pass-end")
	b.ReportMetric(float64(beyond)/gcMiB, "MiB-beyond-need")
	b.ReportMetric(float64(perImage)/gcMiB, "MiB-per-image")
	b.ReportMetric(float64(len(ok)), "images-removed")
	b.ReportMetric(float64(kubelet), "kubelet-images")
	b.ReportMetric(float64(kubeletBeyond)/gcMiB, "kubelet-MiB-beyond-need")
}
