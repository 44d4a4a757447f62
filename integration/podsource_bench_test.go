package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/internal/testenv"
	"github.com/imagefleet/imagefleet/services/podsource"
)

// psTimes records when each pod (by name) was first seen by one consumer.
type psTimes struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

func (s *psTimes) mark(name string) {
	s.mu.Lock()
	if _, ok := s.seen[name]; !ok {
		s.seen[name] = time.Now()
	}
	s.mu.Unlock()
}

func (s *psTimes) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.seen)
}

// latencies returns each pod's delay from created[name] to its sighting, sorted.
func (s *psTimes) latencies(created map[string]time.Time) []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []time.Duration
	for name, at := range s.seen {
		if c, ok := created[name]; ok {
			out = append(out, at.Sub(c))
		}
	}
	slices.Sort(out)
	return out
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return d[min(len(d)-1, int(float64(len(d))*p))]
}

// psTimedPub records when the source published each pod's first event, then passes it to the bus.
type psTimedPub struct {
	b     *bus.Bus
	times *psTimes
}

func (p *psTimedPub) PublishMsgs(ctx context.Context, msgs []bus.RawMsg) (uint64, error) {
	seq, err := p.b.PublishMsgs(ctx, msgs)
	if err == nil {
		for _, m := range msgs {
			if name, ok := podName(m.Data); ok {
				p.times.mark(name)
			}
		}
	}
	return seq, err
}

// podName reads metadata.name without decoding the whole pod.
func podName(data []byte) (string, bool) {
	var p struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(data, &p); err != nil {
		return "", false
	}
	return p.Metadata.Name, true
}

// BenchmarkAPIServerPodSource: 10,000 pods bound to node-1 are created with client-go (16 workers) against a
// real kube-apiserver and etcd while three consumers watch node-1's pods: a raw client-go watch (the
// baseline: what any node agent's watch can get), the API server pod source publishing to a real NATS, and
// the pod index applying those events. Reported: the source's and the raw watch's events/s over the create
// phase, latencies from a pod's create call returning to the raw watch's ADDED and to the source's publish
// (p50, p99), the time until the index holds all 10,000, and then a fresh source's initial sync of the 10,000
// (list, compare with an empty index, publish) beside a raw client-go list of the same pods.
//
// Rows: pods=N (podSourcePods). pods=10000 is the figure and the default; pods=1000, a shorter run while
// working on the benchmark, runs only when -bench names it: -bench 'APIServerPodSource$/pods=1000$'.
func BenchmarkAPIServerPodSource(b *testing.B) {
	for _, r := range testenv.Rows(podSourcePods) {
		b.Run(r.Name, func(b *testing.B) { benchAPIServerPodSource(b, r.Value) })
	}
}

// podSourcePods are BenchmarkAPIServerPodSource's pod counts, a row (pods=N) each.
var podSourcePods = testenv.IntRows("pods", []int{10000}, []int{1000})

// benchAPIServerPodSource is BenchmarkAPIServerPodSource with pods pods.
func benchAPIServerPodSource(b *testing.B, pods int) {
	const node, workers = "node-1", 16
	for range b.N {
		c := kubelab.StartT(b, kubelab.Options{})
		ctx := b.Context()
		admin, err := c.Admin()
		if err != nil {
			b.Fatal(err)
		}
		if err := c.PrepareNamespace(ctx, "bench"); err != nil {
			b.Fatal(err)
		}
		nodeCS, err := kubernetes.NewForConfig(c.NodeConfig(node))
		if err != nil {
			b.Fatal(err)
		}
		_, bs := bustest.Start(b)
		quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
		psStartIndex(b, bs, node, quiet)

		raw := &psTimes{seen: map[string]time.Time{}}
		// The raw baseline: client-go's RetryWatcher (a watch that resumes at its last resourceVersion when the
		// server ends it), as a node agent without an informer would watch.
		start, err := nodeCS.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node, Limit: 1})
		if err != nil {
			b.Fatal(err)
		}
		w, err := watchtools.NewRetryWatcherWithContext(ctx, start.ResourceVersion, &cache.ListWatch{
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = "spec.nodeName=" + node
				return nodeCS.CoreV1().Pods("").Watch(ctx, o)
			},
		})
		if err != nil {
			b.Fatal(err)
		}
		go func() {
			for ev := range w.ResultChan() {
				if p, ok := ev.Object.(*v1.Pod); ok && ev.Type == watch.Added {
					raw.mark(p.Name)
				}
			}
		}()
		published := &psTimes{seen: map[string]time.Time{}}
		src, err := podsource.NewAPIServerSource(podsource.APIServerConfig{Node: node, REST: c.NodeConfig(node), Logger: quiet},
			&psTimedPub{b: bs, times: published}, bs)
		if err != nil {
			b.Fatal(err)
		}
		srcCtx, stopSrc := context.WithCancel(ctx)
		srcDone := make(chan error, 1)
		go func() { srcDone <- src.Run(srcCtx) }()
		for src.Health() != nil {
			time.Sleep(10 * time.Millisecond)
		}

		created := make(map[string]time.Time, pods)
		var cmu sync.Mutex
		var next atomic.Int64
		var wg sync.WaitGroup
		b.ResetTimer()
		t0 := time.Now()
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if i >= int64(pods) {
						return
					}
					p := psPod(fmt.Sprintf("p-%05d", i), node, fmt.Sprintf("registry.example/app-%d:1", i%50))
					if _, err := admin.CoreV1().Pods("bench").Create(ctx, p, metav1.CreateOptions{}); err != nil {
						b.Error(err)
						return
					}
					cmu.Lock()
					created[p.Name] = time.Now()
					cmu.Unlock()
				}
			}()
		}
		wg.Wait()
		createdIn := time.Since(t0)
		deadline := time.Now().Add(5 * time.Minute)
		for (raw.len() < pods || published.len() < pods) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		var rep events.PodsReply
		var qerr error
		for time.Now().Before(deadline) {
			rep = events.PodsReply{}
			if qerr = bs.Request(ctx, events.QuerySubject(node, events.QryPods), events.PodsQuery{Limit: 1}, &rep); qerr == nil && rep.Total == pods {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		indexedIn := time.Since(t0)
		b.StopTimer()
		if rep.Total != pods || raw.len() != pods || published.len() != pods {
			b.Fatalf("after 5 minutes: index %d (%v), raw watch %d, source %d of %d pods", rep.Total, qerr, raw.len(), published.len(), pods)
		}
		rawLat, srcLat := raw.latencies(created), published.latencies(created)
		b.ReportMetric(float64(pods)/createdIn.Seconds(), "creates/s")
		b.ReportMetric(float64(pods)/indexedIn.Seconds(), "indexed-pods/s")
		b.ReportMetric(float64(pct(rawLat, 0.5).Microseconds())/1000, "raw-watch-p50-ms")
		b.ReportMetric(float64(pct(rawLat, 0.99).Microseconds())/1000, "raw-watch-p99-ms")
		b.ReportMetric(float64(pct(srcLat, 0.5).Microseconds())/1000, "source-p50-ms")
		b.ReportMetric(float64(pct(srcLat, 0.99).Microseconds())/1000, "source-p99-ms")
		w.Stop()
		stopSrc()
		if err := <-srcDone; err != nil {
			b.Fatal(err)
		}

		// Initial sync of 10,000 pods: a raw list beside a fresh source into a fresh index.
		t1 := time.Now()
		list, err := nodeCS.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
		if err != nil || len(list.Items) != pods {
			b.Fatalf("raw list: %d pods, %v", len(list.Items), err)
		}
		rawList := time.Since(t1)
		_, bs2 := bustest.Start(b)
		psStartIndex(b, bs2, node, quiet)
		synced := &psTimes{seen: map[string]time.Time{}}
		src2, err := podsource.NewAPIServerSource(podsource.APIServerConfig{Node: node, REST: c.NodeConfig(node), Logger: quiet},
			&psTimedPub{b: bs2, times: synced}, bs2)
		if err != nil {
			b.Fatal(err)
		}
		ctx2, stop2 := context.WithCancel(ctx)
		done2 := make(chan error, 1)
		t2 := time.Now()
		go func() { done2 <- src2.Run(ctx2) }()
		for synced.len() < pods && time.Since(t2) < 5*time.Minute {
			time.Sleep(10 * time.Millisecond)
		}
		syncIn := time.Since(t2)
		stop2()
		if err := <-done2; err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(pods)/rawList.Seconds(), "raw-list-pods/s")
		b.ReportMetric(float64(pods)/syncIn.Seconds(), "source-sync-pods/s")
		b.Logf("%d pods: created in %s; all in the index %s after the first create; raw watch p50 %s p99 %s; source publish p50 %s p99 %s; raw list %s; a fresh source synced them in %s",
			pods, createdIn.Round(time.Millisecond), indexedIn.Round(time.Millisecond), pct(rawLat, .5), pct(rawLat, .99), pct(srcLat, .5), pct(srcLat, .99),
			rawList.Round(time.Millisecond), syncIn.Round(time.Millisecond))
	}
}
