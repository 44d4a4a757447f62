package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/podsource"
)

// psLedger passes pod events to the bus and records each one (action, UID), so a test can show that no
// pod was published twice and no deletion lost.
type psLedger struct {
	b   *bus.Bus
	mu  sync.Mutex
	evs []psEvent
}

type psEvent struct {
	action string
	uid    string
	rv     string
}

func (l *psLedger) PublishMsgs(ctx context.Context, msgs []bus.RawMsg) (uint64, error) {
	seq, err := l.b.PublishMsgs(ctx, msgs)
	if err != nil {
		return seq, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range msgs {
		var p v1.Pod
		_ = json.Unmarshal(m.Data, &p)
		action := m.Header[events.HeaderType]
		for _, a := range []string{events.ActionAdded, events.ActionUpdated, events.ActionDeleted} {
			if action == events.TypeName(events.EntityPod, a) {
				action = a
			}
		}
		l.evs = append(l.evs, psEvent{action: action, uid: string(p.UID), rv: p.ResourceVersion})
	}
	return seq, nil
}

// check returns what is wrong in the ledger: a pod added twice without a deletion between, an update or
// deletion of a pod not added, an event repeating the resource version already published for the pod.
func (l *psLedger) check() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var bad []string
	live := map[string]string{} // uid -> last published resource version
	for i, e := range l.evs {
		rv, ok := live[e.uid]
		switch e.action {
		case events.ActionAdded:
			if ok {
				bad = append(bad, fmt.Sprintf("event %d: %s added again", i, e.uid))
			}
			live[e.uid] = e.rv
		case events.ActionUpdated:
			if !ok {
				bad = append(bad, fmt.Sprintf("event %d: %s updated, never added", i, e.uid))
			} else if rv == e.rv {
				bad = append(bad, fmt.Sprintf("event %d: %s updated with the same resourceVersion %s (a duplicate)", i, e.uid, rv))
			}
			live[e.uid] = e.rv
		case events.ActionDeleted:
			if !ok {
				bad = append(bad, fmt.Sprintf("event %d: %s deleted, never added", i, e.uid))
			}
			delete(live, e.uid)
		}
	}
	return bad
}

func (l *psLedger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.evs)
}

// psIndex asks the pod index for its pods (a page at a time): name -> UID, and the mirror pods apart.
func psIndex(t testing.TB, b *bus.Bus, node string) (pods, mirrors map[string]string) {
	t.Helper()
	pods, mirrors = map[string]string{}, map[string]string{}
	q := events.PodsQuery{}
	for {
		var rep events.PodsReply
		if err := b.Request(t.Context(), events.QuerySubject(node, events.QryPods), q, &rep); err != nil {
			return nil, nil
		}
		for dst, raws := range map[*map[string]string][]json.RawMessage{&pods: rep.Pods, &mirrors: rep.MirrorPods} {
			for _, raw := range raws {
				var p v1.Pod
				if err := json.Unmarshal(raw, &p); err != nil {
					t.Fatal(err)
				}
				(*dst)[p.Namespace+"/"+p.Name] = string(p.UID)
			}
		}
		if !rep.Truncated {
			return pods, mirrors
		}
		q.After = rep.Next
	}
}

// psAPIPods lists the node's pods from the API server: name -> UID.
func psAPIPods(t testing.TB, cs kubernetes.Interface, node string) map[string]string {
	t.Helper()
	list, err := cs.CoreV1().Pods("").List(t.Context(), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, p := range list.Items {
		out[p.Namespace+"/"+p.Name] = string(p.UID)
	}
	return out
}

func psPod(name, node string, image string) *v1.Pod {
	grace := int64(1)
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PodSpec{NodeName: node, HostNetwork: true, DNSPolicy: v1.DNSDefault, TerminationGracePeriodSeconds: &grace,
			Containers: []v1.Container{{Name: "app", Image: image}}},
	}
}

func psForceDelete(ctx context.Context, cs kubernetes.Interface, ns, name string) error {
	zero := int64(0)
	err := cs.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

func psStartIndex(t testing.TB, b *bus.Bus, node string, log *slog.Logger) {
	t.Helper()
	ix, err := podindex.New(podindex.Config{Node: node, Logger: log}, b)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ix.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("pod index: %v", err)
		}
	})
	select {
	case <-ix.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("pod index not ready after 30s")
	}
}

// TestAPIServerPodSource runs the API server pod source as node-1 (its own identity: Node authorizer and
// NodeRestriction, as a node agent in a cluster) against a real kube-apiserver and etcd, with a real NATS and
// pod index:
//   - pods created with client-go for node-1 appear in the index, from the watch (within seconds: the
//     resync, 5 min, is out of reach; the slowest is logged), node-2's never;
//   - their images are in the pod index's in-use answer (what image GC keeps) while they are Pending;
//   - their secrets and configmaps are registered, and unregistered when the pods are deleted;
//   - an API server restart while pods change, during which pods are created and deleted (the source's watch
//     resumes at an old resourceVersion: 410 Gone, then a relist), leaves the index equal to the API server's
//     pods, and no pod was published twice or deleted without being added;
//   - an agent restart (a new source resuming from the index) publishes only what changed while it was down.
func TestAPIServerPodSource(t *testing.T) {
	ctx := t.Context()
	const node = "node-1"
	c := kubelab.StartT(t, kubelab.Options{Nodes: []string{"node-1", "node-2"}})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	const ns = "ps"
	if err := c.PrepareNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	_, b := bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	psStartIndex(t, b, node, log)
	ledger := &psLedger{b: b}
	var health func() error
	newSource := func() *gcWorker {
		src, err := podsource.NewAPIServerSource(podsource.APIServerConfig{Node: node, REST: c.NodeConfig(node), Logger: log}, ledger, b)
		if err != nil {
			t.Fatal(err)
		}
		w := gcStartWorker(t, "apiserver pod source", src.Run)
		health = src.Health
		bustest.WaitWithin(t, "source synced", 30*time.Second, func() bool { return src.Health() == nil })
		return w
	}
	src := newSource()

	// Pods appear from the watch; node-2's never.
	if _, err := admin.CoreV1().Pods(ns).Create(ctx, psPod("other", "node-2", "lab/other:1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	for i := range 5 {
		p := psPod(fmt.Sprintf("p%d", i), node, fmt.Sprintf("registry.example/app-%d:1", i))
		p.Spec.Volumes = []v1.Volume{{Name: "s", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: fmt.Sprintf("sec-%d", i)}}}}
		p.Spec.Containers[0].EnvFrom = []v1.EnvFromSource{{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cm-%d", i)}}}}
		t0 := time.Now()
		created, err := admin.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		bustest.WaitFor(t, "pod "+p.Name+" in the index", func() bool {
			pods, _ := psIndex(t, b, node)
			return pods[ns+"/"+p.Name] == string(created.UID)
		})
		worst = max(worst, time.Since(t0))
	}
	t.Logf("pods in the index at most %s after their create call", worst.Round(time.Millisecond))
	if pods, _ := psIndex(t, b, node); pods[ns+"/other"] != "" {
		t.Fatal("node-2's pod is in node-1's index")
	}

	// Pending pods' images are what the pod index reports in use (image GC keeps them); their secrets and
	// configmaps are registered.
	var inUse events.InUseReply
	gcRequest(t, b, events.QuerySubject(node, events.QryInUse), nil, &inUse)
	for i := range 5 {
		if ref := fmt.Sprintf("registry.example/app-%d:1", i); !slices.Contains(inUse.Images, ref) {
			t.Fatalf("in-use images %v lack %s of a Pending pod", inUse.Images, ref)
		}
	}
	refs := func() []string {
		var rep events.RefsReply
		gcRequest(t, b, events.QuerySubject(node, events.QryRefs), nil, &rep)
		var out []string
		for _, r := range rep.Refs {
			out = append(out, fmt.Sprintf("%s %s/%s %d", r.Kind, r.Namespace, r.Name, r.Count))
		}
		sort.Strings(out)
		return out
	}
	// The ServiceAccount admission plugin gives every pod a projected volume of ConfigMap kube-root-ca.crt.
	wantRefs := func(from int) []string {
		out := []string{fmt.Sprintf("ConfigMap ps/kube-root-ca.crt %d", 5-from)}
		for i := from; i < 5; i++ {
			out = append(out, fmt.Sprintf("ConfigMap ps/cm-%d 1", i), fmt.Sprintf("Secret ps/sec-%d 1", i))
		}
		sort.Strings(out)
		return out
	}
	if got := refs(); !slices.Equal(got, wantRefs(0)) {
		t.Fatalf("refs %v, want %v", got, wantRefs(0))
	}
	for _, name := range []string{"p0", "p1"} {
		if err := psForceDelete(ctx, admin, ns, name); err != nil {
			t.Fatal(err)
		}
	}
	bustest.WaitFor(t, "p0's and p1's secrets and configmaps unregistered", func() bool { return slices.Equal(refs(), wantRefs(2)) })
	gcRequest(t, b, events.QuerySubject(node, events.QryInUse), nil, &inUse)
	if slices.Contains(inUse.Images, "registry.example/app-0:1") {
		t.Fatalf("in-use images %v still hold a deleted pod's image", inUse.Images)
	}

	// An API server restart in the middle of a stream of changes.
	var rv string
	if list, err := admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
		rv = list.ResourceVersion
	}
	stopChurn := make(chan struct{})
	churnDone := make(chan int)
	go func() {
		n := 0
		for i := 0; ; i++ {
			select {
			case <-stopChurn:
				churnDone <- n
				return
			default:
			}
			if _, err := admin.CoreV1().Pods(ns).Create(ctx, psPod(fmt.Sprintf("churn-%d", i), node, "registry.example/churn:1"), metav1.CreateOptions{}); err == nil {
				n++
			}
			if i%3 == 0 {
				_ = psForceDelete(ctx, admin, ns, fmt.Sprintf("churn-%d", i-1))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond)
	c.StopAPIServer(5 * time.Second)
	// Unreachable: the source says so (it probes every 15 s while synced).
	bustest.WaitWithin(t, "the source reports the API server unreachable", 30*time.Second, func() bool { return health() != nil })
	t.Logf("health while the API server is down: %v", health())
	if err := c.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	// While the source's reflector backs off, pods change: one is deleted, one is created.
	if err := psForceDelete(ctx, admin, ns, "p2"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Pods(ns).Create(ctx, psPod("after-restart", node, "registry.example/x:1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	close(stopChurn)
	t.Logf("churn created %d pods around the restart", <-churnDone)
	// The watch the source had cannot resume at its old resourceVersion on the new apiserver: 410 Gone.
	w, err := admin.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: rv})
	if err == nil {
		select {
		case ev := <-w.ResultChan():
			if st, ok := ev.Object.(*metav1.Status); ev.Type != watch.Error || !ok || st.Code != 410 {
				t.Logf("watch from resourceVersion %s after the restart: %s %v (expected 410 Gone)", rv, ev.Type, ev.Object)
			} else {
				t.Logf("watch from resourceVersion %s after the restart: 410 %s", rv, st.Message)
			}
		case <-time.After(5 * time.Second):
		}
		w.Stop()
	} else {
		t.Logf("watch from resourceVersion %s after the restart: %v", rv, err)
	}
	same := func() bool {
		pods, _ := psIndex(t, b, node)
		return maps.Equal(pods, psAPIPods(t, admin, node))
	}
	bustest.WaitWithin(t, "index equal to the API server's pods after the restart", 30*time.Second, same)
	bustest.WaitWithin(t, "the source synced again", 30*time.Second, func() bool { return health() == nil })
	if bad := ledger.check(); len(bad) > 0 {
		t.Fatalf("after the restart: %d wrong events, first: %v", len(bad), bad[:min(len(bad), 5)])
	}

	// The agent restarts: pods change while it is down; the new source publishes exactly those changes.
	src.stop(t, "apiserver pod source")
	before := ledger.count()
	if err := psForceDelete(ctx, admin, ns, "p3"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Pods(ns).Create(ctx, psPod("while-down", node, "registry.example/y:1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	newSource()
	bustest.WaitWithin(t, "index equal to the API server's pods after an agent restart", 30*time.Second, same)
	// A negative check: the ledger counts at publish, so the two changes are in; the sleep lets a wrong
	// third publish show, and cannot make the test fail.
	time.Sleep(200 * time.Millisecond)
	if n := ledger.count() - before; n != 2 {
		t.Fatalf("after an agent restart %d events published, want 2 (p3 deleted, while-down added)", n)
	}
	if bad := ledger.check(); len(bad) > 0 {
		t.Fatalf("after an agent restart: %v", bad)
	}
}
