package integration_test

import (
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/kevents"
	"github.com/imagefleet/imagefleet/services/puller"
)

const keNode = "node-1"

// keBridge runs a kube-events bridge of keNode with durable until stop.
func keBridge(t *testing.T, b *bus.Bus, kube kubernetes.Interface, durable string) (stop func()) {
	t.Helper()
	s, err := kevents.New(t.Context(), kevents.Config{Node: keNode, Durable: durable, RetryMax: time.Second,
		AckWait: 10 * time.Second, Registerer: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))}, kube, b)
	if err != nil {
		t.Fatal(err)
	}
	w := gcStartWorker(t, "kube-events "+durable, s.Run)
	return func() { w.stop(t, "kube-events "+durable) }
}

// keDrained waits until durable has handled every stored event.
func keDrained(t *testing.T, b *bus.Bus, durable string, within time.Duration) {
	t.Helper()
	bustest.Eventually(t, "consumer "+durable+" drained", within, func() error {
		st, err := b.Consumer(t.Context(), events.EventsStream, durable)
		if err == nil && (st.NumPending != 0 || st.NumAckPending != 0) {
			err = fmt.Errorf("%+v", st)
		}
		return err
	})
}

// keEvents lists the Events of namespace ns (admin) as "<object> <fieldPath> <type> <reason> x<count>: <message>".
func keEvents(t *testing.T, admin kubernetes.Interface, ns string) map[string]v1.Event {
	t.Helper()
	list, err := admin.CoreV1().Events(ns).List(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list events in %s: %v", ns, err)
	}
	out := map[string]v1.Event{}
	for _, e := range list.Items {
		if e.Source.Component != kevents.DefaultComponent {
			continue // the API server's own
		}
		out[e.Name] = e
	}
	return out
}

func keSummary(evs map[string]v1.Event) []string {
	var out []string
	for _, e := range evs {
		out = append(out, fmt.Sprintf("%s/%s %s %s %s x%d: %s", e.InvolvedObject.Kind, e.InvolvedObject.Name,
			e.InvolvedObject.FieldPath, e.Type, e.Reason, e.Count, e.Message))
	}
	return out
}

// keCluster starts a kube lab with node keNode and creates pod "web" with spec in namespace ns (prepared as
// the lab needs): the admin's and the node identity's clients, and the pod as the API server stored it.
func keCluster(t *testing.T, ns string, spec v1.PodSpec) (*kubelab.Cluster, *kubernetes.Clientset, *kubernetes.Clientset, *v1.Pod) {
	t.Helper()
	c := kubelab.StartT(t, kubelab.Options{Nodes: []string{keNode}})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	nodeClient, err := kubernetes.NewForConfig(c.NodeConfig(keNode))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.PrepareNamespace(t.Context(), ns); err != nil {
		t.Fatal(err)
	}
	pod, err := admin.CoreV1().Pods(ns).Create(t.Context(), &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web"}, Spec: spec},
		metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c, admin, nodeClient, pod
}

// TestKubeEventsBridge: a real puller's pull events and a real GC executor's FreeDiskSpaceFailed reach a real
// kube-apiserver as the kubelet's Events, posted by the bridge with a node identity: reasons, messages, types,
// the pod's container fieldPath, the Node object; a repeat is one Event with count 2; events about a pod the
// API server does not know and pulls without a pod are not posted. Then: every event delivered again (a new
// consumer reads the stream from the start, as after a restart that acked nothing) posts none twice; and
// events published while the API server is down are all posted, once, after it is back.
func TestKubeEventsBridge(t *testing.T) {
	ctx := t.Context()
	const ns = "kev"
	c, admin, nodeClient, pod := keCluster(t, ns, v1.PodSpec{NodeName: keNode,
		InitContainers: []v1.Container{{Name: "init", Image: "lab/missing:1"}},
		Containers:     []v1.Container{{Name: "app", Image: "lab/app:1"}}})

	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	ctrd := lab.StartContainerd(t, lab.Options{})
	app, err := lab.Push(ctx, reg.Host(), "lab/app:1", 256<<10)
	if err != nil {
		t.Fatal(err)
	}
	missing := reg.Host() + "/lab/missing:1"
	_, b := bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// The real producers: a puller, a detector and a GC executor on the lab's containerd.
	p, err := puller.New(puller.Config{Node: keNode, Logger: log, Registerer: prometheus.NewRegistry()}, ctrd.Client(), b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "puller", p.Run)
	d, err := detector.New(detector.Config{Node: keNode, Period: time.Hour, Logger: log}, ctrd.Client(), b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "detector", d.Run)

	ref := func(field string) *events.PodRef {
		return &events.PodRef{Namespace: ns, Name: pod.Name, UID: string(pod.UID), FieldPath: field}
	}
	pull := func(id, image, policy string, pod *events.PodRef) events.PullResult {
		t.Helper()
		req := events.PullRequest{ID: id, Image: image, Policy: policy, Pod: pod}
		if _, err := puller.Enqueue(ctx, b, keNode, req); err != nil {
			t.Fatal(err)
		}
		var res events.PullResult
		bustest.WaitWithin(t, "the result of pull "+id, 60*time.Second, func() bool {
			var found bool
			_ = b.Read(ctx, events.EventsStream, events.EventSubject(keNode, events.EntityPull, ">"), func(m bus.StreamMsg) error {
				ev, err := events.DecodeEvent(m.Data)
				if err == nil && ev.ID == events.PullResultEventID(id) {
					found = ev.DecodeData(&res) == nil
				}
				if found {
					return bus.StopReading
				}
				return nil
			})
			return found
		})
		return res
	}
	okPull := pull("ke-app", app.Ref, events.PullAlways, ref("spec.containers{app}"))
	failPull := pull("ke-missing", missing, events.PullIfNotPresent, ref("spec.initContainers{init}"))
	if okPull.Error != "" || failPull.Error == "" {
		t.Fatalf("pulls: app %+v, missing %+v: want a success and a failure", okPull, failPull)
	}
	pull("ke-prepull", app.Ref, events.PullIfNotPresent, nil)                                                          // no pod: logged only
	pull("ke-ghost", app.Ref, events.PullIfNotPresent, &events.PodRef{Namespace: ns, Name: "ghost", UID: "ghost-uid"}) // not in the API

	// GC: a quota the one image fills, everything pinned: nothing can be freed, twice.
	g, err := gc.New(gc.Config{Node: keNode, Policy: gc.Policy{HighThresholdPercent: 85, LowThresholdPercent: 80},
		CapacityBytes: int64(okPull.ImageSize), PinnedImages: []string{"*"}, Period: time.Hour, CheckPeriod: time.Hour,
		Registerer: prometheus.NewRegistry(), Logger: log}, gc.Deps{Runtime: ctrd.Client(), Bus: b})
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "gc", g.Run)
	var gcRes events.GCResult
	for range 2 {
		gcRequest(t, b, events.CommandSubject(keNode, events.VerbGC), events.GCRequest{}, &gcRes)
	}
	if !strings.HasPrefix(gcRes.Error, "Insufficient free disk space") {
		t.Fatalf("gc result %+v: want FreeDiskSpaceFailed's error", gcRes)
	}

	// diskWarnings counts the FreeDiskSpaceFailed warnings GC published (its usage check may add passes of its
	// own after a pull): the Events must count exactly these.
	diskWarnings := func() int32 {
		n := int32(0)
		err := b.Read(ctx, events.EventsStream, events.EventSubject(keNode, events.EntityNode, events.ActionWarning), func(m bus.StreamMsg) error {
			if ev, err := events.DecodeEvent(m.Data); err == nil && ev.Reason == gc.EventFreeDiskSpaceFailed {
				n++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	const durable = "kube-events-node-1"
	stop := keBridge(t, b, nodeClient, durable)
	keDrained(t, b, durable, 60*time.Second)
	warned := diskWarnings()

	podEvs := keEvents(t, admin, ns)
	nodeEvs := keEvents(t, admin, metav1.NamespaceDefault)
	t.Logf("pod events:\n  %s", strings.Join(keSummary(podEvs), "\n  "))
	t.Logf("node events:\n  %s", strings.Join(keSummary(nodeEvs), "\n  "))
	type want struct {
		field, typ, reason string
		msg                *regexp.Regexp
	}
	q := regexp.QuoteMeta
	wants := []want{
		{"spec.containers{app}", v1.EventTypeNormal, "Pulling", regexp.MustCompile(`^` + q(`Pulling image "`+app.Ref+`"`) + `$`)},
		{"spec.containers{app}", v1.EventTypeNormal, "Pulled", regexp.MustCompile(`^` + q(`Successfully pulled image "`+app.Ref+`" in `) +
			`[0-9.]+m?s \([0-9.]+m?s including waiting\)\. Image size: [0-9]+ bytes\.$`)},
		{"spec.initContainers{init}", v1.EventTypeNormal, "Pulling", regexp.MustCompile(`^` + q(`Pulling image "`+missing+`"`) + `$`)},
		{"spec.initContainers{init}", v1.EventTypeWarning, "Failed", regexp.MustCompile(`^` + q(`Failed to pull image "`+missing+`": `) + `.+`)},
	}
	if len(podEvs) != len(wants) {
		t.Errorf("%d pod Events, want %d (none for the ghost pod or the pre-pull)", len(podEvs), len(wants))
	}
	for _, w := range wants {
		n := 0
		for _, e := range podEvs {
			o := e.InvolvedObject
			if o.FieldPath == w.field && e.Reason == w.reason {
				n++
				if o.Kind != "Pod" || o.Name != "web" || o.Namespace != ns || o.UID != pod.UID || o.APIVersion != "v1" ||
					e.Type != w.typ || !w.msg.MatchString(e.Message) || e.Count != 1 || e.Source.Host != keNode {
					t.Errorf("event %s: %+v %s %s %q x%d, want %s %s matching %s once", e.Name, o, e.Type, e.Reason, e.Message, e.Count, w.typ, w.reason, w.msg)
				}
			}
		}
		if n != 1 {
			t.Errorf("%d Events %s %s, want 1", n, w.field, w.reason)
		}
	}
	var diskEv v1.Event
	for _, e := range nodeEvs {
		if e.Reason == gc.EventFreeDiskSpaceFailed {
			if diskEv.Name != "" {
				t.Errorf("two FreeDiskSpaceFailed Events: want one with count 2")
			}
			diskEv = e
		}
	}
	if o := diskEv.InvolvedObject; o.Kind != "Node" || o.Name != keNode || string(o.UID) != keNode || o.Namespace != "" ||
		diskEv.Type != v1.EventTypeWarning || diskEv.Count != warned || warned < 2 || diskEv.Message != gcRes.Error {
		t.Errorf("FreeDiskSpaceFailed Event %+v x%d %q, want on Node %s, Warning, count %d (at least 2), message %q", o, diskEv.Count, diskEv.Message, keNode, warned, gcRes.Error)
	}
	stop()

	// Every event again, from the start of the stream: the decided writes are replayed, nothing new.
	stop = keBridge(t, b, nodeClient, durable+"-again")
	keDrained(t, b, durable+"-again", 60*time.Second)
	stop()
	if again := keEvents(t, admin, ns); len(again) != len(podEvs) {
		t.Errorf("after redelivery %d pod Events, before %d:\n%s", len(again), len(podEvs), strings.Join(keSummary(again), "\n"))
	}
	if again := keEvents(t, admin, metav1.NamespaceDefault); len(again) != len(nodeEvs) || again[diskEv.Name].Count != warned {
		t.Errorf("after redelivery node Events %s: want them unchanged", keSummary(again))
	}

	// The API server away while events come: held, then posted once each.
	c.StopAPIServer(5 * time.Second)
	stop = keBridge(t, b, nodeClient, durable)
	for i := range 20 {
		ev, err := events.New(keNode, events.EntityPull, events.ActionPulled, nil)
		if err != nil {
			t.Fatal(err)
		}
		msg := fmt.Sprintf("Container image %q already present on machine and can be accessed by the pod", fmt.Sprintf("lab/img%d:1", i))
		ev = ev.WithKube(events.Normal, "Pulled", msg, &events.ObjectRef{Kind: "Pod", Namespace: ns, Name: "web", UID: string(pod.UID), FieldPath: "spec.containers{app}"})
		if err := b.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	// More failures: the restarted bridge's correlator (in memory, like the kubelet's) makes them one new
	// Event counting them.
	for range 2 {
		gcRequest(t, b, events.CommandSubject(keNode, events.VerbGC), events.GCRequest{}, &gcRes)
	}
	time.Sleep(3 * time.Second) // the bridge meets the outage
	if err := c.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	keDrained(t, b, durable, 90*time.Second)
	stop()
	// 20 Pulled with 20 messages on one object in 10 minutes: client-go's aggregator, as the kubelet's,
	// posts the first 9 as they are and the rest as one "(combined from similar events)" Event counting 11.
	after := keEvents(t, admin, ns)
	total, combined := 0, 0
	for name, e := range after {
		if _, old := podEvs[name]; old {
			continue
		}
		total += int(e.Count)
		if strings.HasPrefix(e.Message, "(combined from similar events): ") {
			combined++
		}
		if e.Reason != "Pulled" || !strings.Contains(e.Message, "already present on machine") {
			t.Errorf("event after the outage %s: %s x%d %q", name, e.Reason, e.Count, e.Message)
		}
	}
	if total != 20 || combined != 1 || len(after) != len(podEvs)+10 {
		t.Errorf("after the outage %d new pod Events counting %d (%d combined), want 10 counting 20 (1 combined):\n%s",
			len(after)-len(podEvs), total, combined, strings.Join(keSummary(after), "\n"))
	}
	nodeAfter := keEvents(t, admin, metav1.NamespaceDefault)
	more := diskWarnings() - warned
	if len(nodeAfter) != len(nodeEvs)+1 || nodeAfter[diskEv.Name].Count != warned {
		t.Errorf("node Events after the outage %s: want the old one kept (count %d) and one new", keSummary(nodeAfter), warned)
	}
	for name, e := range nodeAfter {
		if _, old := nodeEvs[name]; !old && (e.Reason != gc.EventFreeDiskSpaceFailed || e.Count != more || more < 2) {
			t.Errorf("node Event after the outage %s: %s x%d, want FreeDiskSpaceFailed x%d (at least 2)", name, e.Reason, e.Count, more)
		}
	}
}
