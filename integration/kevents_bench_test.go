package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/services/kevents"
)

// BenchmarkKubeEvents: imagefleet events posted as Kubernetes Events through the bridge (real nats-server,
// real kube-apiserver + etcd, the node identity; correlator, decided write in the bucket, create or patch)
// beside raw client-go Event creates of the same objects in the same run. The events are Pulled on 50 pods
// (VerifyPods off: no pod lookups), each with its own message, so client-go's aggregation combines a pod's
// 11th and later similar Events into one patched Event, as the kubelet's recorder would.
func BenchmarkKubeEvents(b *testing.B) {
	c := kubelab.StartT(b, kubelab.Options{Nodes: []string{keNode}})
	ctx := context.Background()
	const ns = "kev-bench"
	if err := c.PrepareNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	for _, limit := range []struct {
		name  string
		qps   float32
		burst int
	}{{"kubelet", 50, 100}, {"none", -1, 0}} {
		rc := c.NodeConfig(keNode)
		// qps=kubelet: the kubelet's eventRecordQPS and eventBurst, as the agent sets them; qps=none: no
		// client-side limit, so the figures show what the bridge itself costs.
		rc.QPS, rc.Burst = limit.qps, limit.burst
		kube, err := kubernetes.NewForConfig(rc)
		if err != nil {
			b.Fatal(err)
		}
		b.Run("qps="+limit.name, func(b *testing.B) { benchKubeEvents(b, kube, ns) })
	}
}

func benchKubeEvents(b *testing.B, kube kubernetes.Interface, ns string) {
	ctx := context.Background()
	const pods = 50
	var raw float64
	b.Run("path=raw-create", func(b *testing.B) {
		b.ReportAllocs()
		start := time.Now()
		for i := range b.N {
			now := metav1.Now()
			e := &v1.Event{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("raw-%d.%x", i, now.UnixNano()), Namespace: ns},
				InvolvedObject: v1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: ns, Name: fmt.Sprintf("p%d", i%pods), FieldPath: "spec.containers{app}"},
				Reason:         "Pulled", Message: fmt.Sprintf("Container image %q already present on machine", fmt.Sprintf("r/img%d:1", i)),
				FirstTimestamp: now, LastTimestamp: now, Count: 1, Type: v1.EventTypeNormal, Source: v1.EventSource{Component: "raw", Host: keNode}}
			if _, err := kube.CoreV1().Events(ns).Create(ctx, e, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
		}
		raw = float64(b.N) / time.Since(start).Seconds()
		b.ReportMetric(raw, "events/s")
		b.ReportMetric(raw, "writes/s")
	})
	b.Run("path=bridge", func(b *testing.B) {
		b.ReportAllocs()
		_, nb := bustest.Start(b)
		off := false
		reg := prometheus.NewRegistry()
		durable := fmt.Sprintf("kube-events-bench-%d-%d", b.N, time.Now().UnixNano())
		s, err := kevents.New(ctx, kevents.Config{Node: keNode, Durable: durable, VerifyPods: &off, Registerer: reg,
			Logger: slog.New(slog.DiscardHandler)}, kube, nb)
		if err != nil {
			b.Fatal(err)
		}
		evs := make([]events.Event, b.N)
		for i := range evs {
			ev, err := events.New(keNode, events.EntityPull, events.ActionPulled, nil)
			if err != nil {
				b.Fatal(err)
			}
			evs[i] = ev.WithKube(events.Normal, "Pulled", fmt.Sprintf("Container image %q already present on machine", fmt.Sprintf("r/img%d-%d:1", time.Now().UnixNano(), i)),
				&events.ObjectRef{Kind: "Pod", Namespace: ns, Name: fmt.Sprintf("p%d", i%pods), UID: fmt.Sprintf("uid-%d", i%pods), FieldPath: "spec.containers{app}"})
		}
		if err := nb.PublishAll(ctx, evs); err != nil {
			b.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		b.ResetTimer()
		start := time.Now()
		go func() { done <- s.Run(rctx) }()
		for {
			st, err := nb.Consumer(ctx, events.EventsStream, durable)
			if err == nil && st.NumPending == 0 && st.NumAckPending == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		elapsed := time.Since(start)
		b.StopTimer()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		rate := float64(b.N) / elapsed.Seconds()
		b.ReportMetric(rate, "events/s")
		// API writes: the events the spam filter let through, as creates or count patches.
		writes := 0.0
		mfs, err := reg.Gather()
		if err != nil {
			b.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "imagefleet_kube_events_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "result" && (l.GetValue() == "created" || l.GetValue() == "patched") {
						writes += m.GetCounter().GetValue()
					}
				}
			}
		}
		b.ReportMetric(writes/elapsed.Seconds(), "writes/s")
		if raw > 0 {
			b.ReportMetric(rate/raw, "ratio-to-raw")
		}
	})
}
