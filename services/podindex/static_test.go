package podindex

import (
	"context"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	v1 "k8s.io/api/core/v1"

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
		ev, err := DecodePodEvent(m.Subject, map[string][]string{events.HeaderType: {m.Header[events.HeaderType]}}, m.Data)
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
	if err := src.syncManifests(ctx); err != nil {
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
	if err := src.syncManifests(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := pub.take(t); len(evs) != 0 {
		t.Fatalf("an unchanged directory published %d events", len(evs))
	}

	// A changed manifest is a new pod (its UID is its hash): the old one is deleted.
	write("etcd.yaml", etcdYAML+"    args: [\"--debug\"]\n")
	if err := src.syncManifests(ctx); err != nil {
		t.Fatal(err)
	}
	evs = pub.take(t)
	if len(evs) != 2 || evs[0].Action != events.ActionAdded || evs[1].Action != events.ActionDeleted ||
		evs[1].Pod.UID != etcd.UID || evs[0].Pod.UID == etcd.UID {
		t.Fatalf("after a change: %d events %v", len(evs), evs)
	}

	// A manifest with its own UID changes in place: updated, with the first seen time kept.
	write("fixed.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: fixed, uid: fixed-uid}\nspec: {containers: [{name: c, image: a:1}]}\n")
	if err := src.syncManifests(ctx); err != nil {
		t.Fatal(err)
	}
	first := pub.take(t)
	now = now.Add(time.Minute)
	write("fixed.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: fixed, uid: fixed-uid}\nspec: {containers: [{name: c, image: a:2}]}\n")
	if err := src.syncManifests(ctx); err != nil {
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
	if err := src.syncManifests(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := pub.take(t); len(evs) != 1 || evs[0].Action != events.ActionDeleted || evs[0].Pod.UID != sched.UID {
		t.Fatalf("after removing sched: %v", evs)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := src.syncManifests(ctx); err == nil {
		t.Fatal("a missing path is not reported")
	}
	if evs := pub.take(t); len(evs) != 2 {
		t.Fatalf("a missing directory deleted %d pods, want 2", len(evs))
	}
}

func TestStaticPodUIDIsStable(t *testing.T) {
	a, err := decodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-a")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := decodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-a")
	c, _ := decodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd.yaml", "node-b")
	d, _ := decodeManifest([]byte(etcdYAML), "/etc/kubernetes/manifests/etcd2.yaml", "node-a")
	if a.UID != b.UID || a.UID == c.UID || a.UID == d.UID {
		t.Fatalf("uids: same %s %s, other node %s, other path %s", a.UID, b.UID, c.UID, d.UID)
	}
	for _, bad := range []struct{ manifest, err string }{
		{"kind: Pod\napiVersion: v1\nspec: {containers: [{name: c}]}", "f: invalid pod: name is needed for the pod"},
		{"kind: Secret\napiVersion: v1\nmetadata: {name: x}", `f: couldn't parse as pod(kind "Secret", apiVersion "v1"), please check config file`},
		{"kind: Pod\nmetadata: {name: x}", "f: invalid pod: spec.containers: Required value"},
		{"", "f: manifest is empty"},
		{"# only a comment\n", "f: manifest is empty"},
		{"kind: Pod\nmetadata: [", "f: couldn't parse as pod(yaml: line 2: did not find expected node content), please check config file"},
		// What the kubelet's validation of a file pod refuses most often (see validateStaticPod).
		{"kind: Pod\nmetadata: {name: Bad_Name}\nspec: {containers: [{name: c, image: a}]}",
			`f: invalid pod: [metadata.name: Invalid value: "Bad_Name-n": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')]`},
		{"kind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: C!}, {name: c, image: a}, {name: c, image: b}]}",
			`f: invalid pod: [spec.containers[0].name: Invalid value: "C!": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?') spec.containers[0].image: Required value spec.containers[2].name: Duplicate value: "c"]`},
		{"kind: Pod\nmetadata: {name: x, namespace: Prod}\nspec: {volumes: [{name: v, emptyDir: {}}, {name: v, emptyDir: {}}, {name: w}], containers: [{name: c, image: a}]}",
			`f: invalid pod: [metadata.namespace: Invalid value: "Prod": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?') spec.volumes[1].name: Duplicate value: "v" spec.volumes[2]: Required value: must specify a volume type]`},
		// Regular containers first; an init container named as a regular one is the duplicate; images with
		// spaces around them last.
		{"kind: Pod\nmetadata: {name: x}\nspec: {initContainers: [{name: c, image: 'i '}], containers: [{name: c, image: ' '}]}",
			`f: invalid pod: [spec.initContainers[0].name: Duplicate value: "c" spec.containers[0].image: Invalid value: " ": must not have leading or trailing whitespace spec.initContainers[0].image: Invalid value: "i ": must not have leading or trailing whitespace]`},
	} {
		if _, err := decodeManifest([]byte(bad.manifest), "f", "n"); err == nil || err.Error() != bad.err {
			t.Errorf("%q: error %v, want %s", bad.manifest, err, bad.err)
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
	stop := bustest.RunService(t, src)
	if err := os.WriteFile(filepath.Join(dir, "etcd.yaml"), []byte(etcdYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	var evs []PodEvent
	bustest.WaitFor(t, "the watched manifest", func() bool {
		evs = append(evs, pub.take(t)...)
		return len(evs) > 0
	})
	if evs[0].Action != events.ActionAdded || evs[0].Pod.Name != "etcd-node-a" {
		t.Fatalf("event %s %s", evs[0].Action, evs[0].Pod.Name)
	}
	stop()
}

// FuzzDecodeManifest feeds decodeManifest any bytes as a manifest: it must not panic; an error must name the
// file and say what is wrong in a bounded message (it is logged for every bad file at every resync); and a
// pod it accepts must carry the kubelet's file-source defaults, get the same UID again, and be accepted by
// the pod index's own decoder once published.
func FuzzDecodeManifest(f *testing.F) {
	for _, seed := range []string{
		etcdYAML,
		schedJSON,
		"apiVersion: v1\nkind: Pod\nmetadata: {name: fixed, uid: fixed-uid, namespace: ns}\nspec: {containers: [{name: c, image: a:1}]}\n",
		"apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  annotations: {a: b}\nspec:\n  tolerations: [{operator: Exists, effect: NoExecute}]\n" +
			"  containers:\n  - name: c\n    image: nginx\n    envFrom: [{secretRef: {name: s}}]\n  volumes: [{name: v, configMap: {name: cm}}]\n",
		"kind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n---\nkind: Pod\nmetadata: {name: b}\n",
		"base: &b {name: c, image: x}\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [*b]}\n",
		`{"kind":"Pod","apiVersion":"v1","metadata":{"name":"a","uid":""},"spec":{"containers":[{"name":"c"}]},"status":{"phase":"Running"}}`,
		// Broken ones.
		"",
		"null",
		"[]",
		"kind: Pod\nmetadata: [",
		"kind: Pod\napiVersion: v1\nspec: {containers: [{name: c}]}",
		"kind: Secret\napiVersion: v1\nmetadata: {name: x}",
		"kind: Pod\nmetadata: {name: x}",
		"kind: Pod\napiVersion: v2\nmetadata: {name: x}\nspec: {containers: [{name: c}]}",
		`{"kind":"Pod","metadata":{"name":1}}`,
		`{"kind":"Pod","metadata":{"name":"a"},"spec":{"containers":[{"name":"c"}],"hostNetwork":"yes"}}`,
		"kind: Pod\n\tmetadata: {name: x}\n",
		"kind: Pod\nmetadata: {name: x, name: y}\nspec: {containers: [{name: c}]}\n",
		"\xff\xfe\x00k\x00i\x00n\x00d",
	} {
		f.Add([]byte(seed), "node-a")
	}
	f.Fuzz(func(t *testing.T, data []byte, node string) {
		if events.ValidateNodeName(node) != nil {
			node = "node-a" // the source only runs with a valid node name
		}
		const path = "/etc/kubernetes/manifests/fuzz.yaml"
		pod, err := decodeManifest(data, path, node)
		if err != nil {
			msg := err.Error()
			if !strings.HasPrefix(msg, path+": ") || len(msg) <= len(path)+2 {
				t.Fatalf("error %q does not start with the file name and a reason", msg)
			}
			if len(msg) > len(path)+2*maxManifestErrorBytes {
				t.Fatalf("error of %d bytes for a manifest of %d: %.200q...", len(msg), len(data), msg)
			}
			return
		}
		if len(pod.Spec.Containers) == 0 || pod.UID == "" || pod.Namespace == "" || pod.Kind != "Pod" ||
			!strings.HasSuffix(pod.Name, "-"+node) || pod.Name == "-"+node || pod.Spec.NodeName != node ||
			pod.Status.Phase != v1.PodPending || pod.Annotations[ConfigHashAnnotationKey] != string(pod.UID) ||
			pod.Annotations[ConfigSourceAnnotationKey] != FileSource || !IsStaticPod(pod) {
			t.Fatalf("accepted pod lacks the file-source defaults: %s/%s uid %q node %q phase %q annotations %v",
				pod.Namespace, pod.Name, pod.UID, pod.Spec.NodeName, pod.Status.Phase, pod.Annotations)
		}
		tolerated := false
		for _, tol := range pod.Spec.Tolerations {
			tolerated = tolerated || (tol.Operator == v1.TolerationOpExists && tol.Effect == v1.TaintEffectNoExecute && tol.Key == "")
		}
		if !tolerated {
			t.Fatalf("accepted pod lacks the NoExecute toleration: %+v", pod.Spec.Tolerations)
		}
		again, err := decodeManifest(data, path, node)
		if err != nil || again.UID != pod.UID {
			t.Fatalf("decoding again gave uid %q, err %v; first %q", again.UID, err, pod.UID)
		}
		m, err := PodEventMsg(node, events.ActionAdded, pod, "", time.Now())
		if err != nil {
			t.Fatalf("accepted pod does not encode: %v", err)
		}
		ev, err := DecodePodEvent(m.Subject, nil, m.Data)
		if err != nil || ev.Pod.UID != pod.UID {
			t.Fatalf("the index rejects an accepted manifest's pod event: %v", err)
		}
	})
}

// TestStaticSourceResumesOnABusyNode: a restarted source learns its static pods from the index a page at a
// time, of file-source pods only, so a node whose pods' JSON is well over NATS's 1 MiB still has a manifest
// removed while the source was down deleted (here with pages of one pod, so the source must page) (one unpaged question failed "over the max payload", and the
// pod stayed in the index, its secrets registered and its images in use).
func TestStaticSourceResumesOnABusyNode(t *testing.T) {
	b := startBus(t)
	s, stop := startService(t, b, Config{Node: testNode})
	defer stop()
	note := strings.Repeat("x", 600)
	var busy []*v1.Pod
	for k := range 2500 {
		p := testPod("apps", fmt.Sprintf("web-%d", k), fmt.Sprintf("uid-web-%d", k), []string{"s"}, nil, "web:1")
		p.Annotations = map[string]string{"note": note}
		busy = append(busy, p)
	}
	last := publish(t, b, testNode, events.ActionAdded, busy...)

	dir := t.TempDir()
	for name, body := range map[string]string{"etcd.yaml": etcdYAML, "sched.json": schedJSON} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := StaticConfig{Node: testNode, ManifestPath: dir, ResyncPeriod: time.Hour}
	first, err := NewStaticSource(cfg, b, b)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.syncManifests(t.Context()); err != nil {
		t.Fatal(err)
	}
	etcdName := "etcd-" + testNode
	bustest.WaitFor(t, "the static pods applied", func() bool {
		_, ok := s.State().Index.getPodByName("kube-system", etcdName)
		return ok && s.State().Applied() > last
	})
	if rep, err := s.state.listPods(testNode, events.PodsQuery{}); err != nil || !rep.Truncated {
		t.Fatalf("the whole listing fits one page (truncated %v, err %v): the test needs more pods", rep.Truncated, err)
	}

	// The source is down; etcd's manifest goes; the source comes back. Pages of one pod each, so it has to
	// page through its two pods (sched, then etcd, in sort order) to learn of etcd.
	defer func(n int) { pageBytes = n }(pageBytes)
	pageBytes = 1
	if err := os.Remove(filepath.Join(dir, "etcd.yaml")); err != nil {
		t.Fatal(err)
	}
	second, err := NewStaticSource(cfg, b, b)
	if err != nil {
		t.Fatal(err)
	}
	second.resume(t.Context())
	if err := second.syncManifests(t.Context()); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the removed manifest's pod deleted", func() bool {
		_, ok := s.State().Index.getPodByName("kube-system", etcdName)
		return !ok
	})
	if _, ok := s.State().Index.getPodByName("default", "sched-"+testNode); !ok {
		t.Fatal("the static pod still in the manifests was deleted")
	}
}
