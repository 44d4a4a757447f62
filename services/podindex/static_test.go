package podindex

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

type fakePublisher struct {
	mu   sync.Mutex
	msgs []bus.RawMsg
}

func (f *fakePublisher) PublishMsgs(_ context.Context, msgs []bus.RawMsg) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs = append(f.msgs, msgs...)
	return uint64(len(f.msgs)), nil
}

// take returns the published events as "action name uid" and forgets them.
func (f *fakePublisher) take(t *testing.T) []PodEvent {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []PodEvent
	for _, m := range f.msgs {
		ev, err := DecodePodEvent(m.Subject, map[string][]string{bus.HeaderType: {m.Header[bus.HeaderType]}}, m.Data)
		if err != nil {
			t.Fatalf("the source published a malformed event: %v", err)
		}
		out = append(out, ev)
	}
	f.msgs = nil
	sort.Slice(out, func(i, j int) bool { return out[i].Action+out[i].Pod.Name < out[j].Action+out[j].Pod.Name })
	return out
}

const etcdYAML = `apiVersion: v1
kind: Pod
metadata:
  name: etcd
  namespace: kube-system
spec:
  containers:
  - name: etcd
    image: registry.k8s.io/etcd:3.5.21-0
`

const schedJSON = `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"sched"},"spec":{"containers":[{"name":"s","image":"sched:1"}]}}`

func TestStaticSourceSync(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("etcd.yaml", etcdYAML)
	write("sched.json", schedJSON)
	write(".hidden.yaml", etcdYAML)
	write("broken.yaml", "kind: Pod\nmetadata: [")
	now := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	pub := &fakePublisher{}
	src, err := NewStaticSource(StaticConfig{Node: "Node-A", ManifestPath: dir + "/", Now: func() time.Time { return now }}, pub, nil)
	if err == nil {
		t.Fatal("an invalid node name was accepted")
	}
	src, err = NewStaticSource(StaticConfig{Node: "node-a", ManifestPath: dir + "/", Now: func() time.Time { return now }}, pub, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	evs := pub.take(t)
	if len(evs) != 2 {
		t.Fatalf("published %d events, want 2 (the hidden and the broken manifests are skipped)", len(evs))
	}
	etcd, sched := evs[0].Pod, evs[1].Pod
	if evs[0].Action != events.ActionAdded || etcd.Name != "etcd-node-a" || etcd.Namespace != "kube-system" {
		t.Fatalf("etcd event %s %s/%s", evs[0].Action, etcd.Namespace, etcd.Name)
	}
	if sched.Namespace != "default" || sched.Spec.NodeName != "node-a" || sched.Status.Phase != "Pending" {
		t.Fatalf("sched defaults: ns %q node %q phase %q", sched.Namespace, sched.Spec.NodeName, sched.Status.Phase)
	}
	for _, p := range []*PodEvent{&evs[0], &evs[1]} {
		a := p.Pod.Annotations
		if a[ConfigSourceAnnotationKey] != "file" || a[ConfigHashAnnotationKey] != string(p.Pod.UID) || len(p.Pod.UID) != 32 ||
			a[ConfigFirstSeenAnnotationKey] != "2026-01-02T03:04:05.000000006Z" {
			t.Errorf("%s: uid %q annotations %v", p.Pod.Name, p.Pod.UID, a)
		}
		if !IsStaticPod(p.Pod) || IsMirrorPod(p.Pod) {
			t.Errorf("%s is not a static pod", p.Pod.Name)
		}
		if tol := p.Pod.Spec.Tolerations; len(tol) != 1 || tol[0].Effect != "NoExecute" || tol[0].Operator != "Exists" {
			t.Errorf("%s tolerations %+v", p.Pod.Name, tol)
		}
	}

	// Nothing changed: nothing published, even later.
	now = now.Add(time.Minute)
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := pub.take(t); len(evs) != 0 {
		t.Fatalf("an unchanged directory published %d events", len(evs))
	}

	// A changed manifest is a new pod (its UID is its hash): the old one is deleted.
	write("etcd.yaml", etcdYAML+"    args: [\"--debug\"]\n")
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	evs = pub.take(t)
	if len(evs) != 2 || evs[0].Action != events.ActionAdded || evs[1].Action != events.ActionDeleted ||
		evs[1].Pod.UID != etcd.UID || evs[0].Pod.UID == etcd.UID {
		t.Fatalf("after a change: %d events %v", len(evs), evs)
	}

	// A manifest with its own UID changes in place: updated, with the first seen time kept.
	write("fixed.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: fixed, uid: fixed-uid}\nspec: {containers: [{name: c, image: a:1}]}\n")
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	first := pub.take(t)
	now = now.Add(time.Minute)
	write("fixed.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: fixed, uid: fixed-uid}\nspec: {containers: [{name: c, image: a:2}]}\n")
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	evs = pub.take(t)
	if len(first) != 1 || len(evs) != 1 || evs[0].Action != events.ActionUpdated || evs[0].Pod.UID != "fixed-uid" ||
		evs[0].Pod.Annotations[ConfigFirstSeenAnnotationKey] != first[0].Pod.Annotations[ConfigFirstSeenAnnotationKey] {
		t.Fatalf("in-place update: %v then %v", first, evs)
	}

	// A removed manifest deletes its pod; a missing directory deletes them all.
	if err := os.Remove(filepath.Join(dir, "sched.json")); err != nil {
		t.Fatal(err)
	}
	if err := src.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := pub.take(t); len(evs) != 1 || evs[0].Action != events.ActionDeleted || evs[0].Pod.UID != sched.UID {
		t.Fatalf("after removing sched: %v", evs)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := src.Sync(ctx); err == nil {
		t.Fatal("a missing path is not reported")
	}
	if evs := pub.take(t); len(evs) != 2 {
		t.Fatalf("a missing directory deleted %d pods, want 2", len(evs))
	}
}

func TestStaticPodUIDIsStable(t *testing.T) {
	a, err := DecodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-a")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := DecodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-a")
	c, _ := DecodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-b")
	d, _ := DecodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd2.yaml", "node-a")
	if a.UID != b.UID || a.UID == c.UID || a.UID == d.UID {
		t.Fatalf("uids: same %s %s, other node %s, other path %s", a.UID, b.UID, c.UID, d.UID)
	}
	for _, bad := range []string{"kind: Pod\napiVersion: v1\nspec: {containers: [{name: c}]}", "kind: Secret\napiVersion: v1\nmetadata: {name: x}", "kind: Pod\nmetadata: {name: x}"} {
		if _, err := DecodeManifest([]byte(bad), "f", "n"); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func TestStaticSourceRunWatchesAndStops(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	dir := t.TempDir()
	pub := &fakePublisher{}
	src, err := NewStaticSource(StaticConfig{Node: "node-a", ManifestPath: dir, ResyncPeriod: time.Hour}, pub, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	if err := os.WriteFile(filepath.Join(dir, "etcd.yaml"), []byte(etcdYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	var evs []PodEvent
	waitFor(t, "the watched manifest", func() bool {
		evs = append(evs, pub.take(t)...)
		return len(evs) > 0
	})
	if evs[0].Action != events.ActionAdded || evs[0].Pod.Name != "etcd-node-a" {
		t.Fatalf("event %s %s", evs[0].Action, evs[0].Pod.Name)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
