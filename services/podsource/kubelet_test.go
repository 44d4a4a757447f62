package podsource

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	podsv1alpha1 "k8s.io/kubelet/pkg/apis/pods/v1alpha1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/podindex"
)

const testNode = "node-1"

// podsServer implements the kubelet's Pods API (the real v1alpha1 service over a unix socket) with pods the
// test sets, and can break every stream or send bytes that are no pod.
type podsServer struct {
	podsv1alpha1.UnimplementedPodsServer
	mu       sync.Mutex
	order    []string
	pods     map[string][]byte
	junk     [][]byte // sent, after the pods, before INITIAL_SYNC_COMPLETE
	watchers map[chan *podsv1alpha1.WatchPodsEvent]chan struct{}
	streams  int
}

func (s *podsServer) WatchPods(_ *podsv1alpha1.WatchPodsRequest, stream grpc.ServerStreamingServer[podsv1alpha1.WatchPodsEvent]) error {
	s.mu.Lock()
	s.streams++
	var initial []*podsv1alpha1.WatchPodsEvent
	for _, uid := range s.order {
		initial = append(initial, &podsv1alpha1.WatchPodsEvent{Type: podsv1alpha1.EventType_ADDED, Pod: s.pods[uid]})
	}
	for _, j := range s.junk {
		initial = append(initial, &podsv1alpha1.WatchPodsEvent{Type: podsv1alpha1.EventType_ADDED, Pod: j})
	}
	initial = append(initial, &podsv1alpha1.WatchPodsEvent{Type: podsv1alpha1.EventType_INITIAL_SYNC_COMPLETE})
	ch, kick := make(chan *podsv1alpha1.WatchPodsEvent, 100), make(chan struct{})
	s.watchers[ch] = kick
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.watchers, ch)
		s.mu.Unlock()
	}()
	for _, ev := range initial {
		if err := stream.Send(ev); err != nil {
			return err
		}
	}
	for {
		select {
		case ev := <-ch:
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-kick:
			return status.Error(codes.Unavailable, "test: stream broken")
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (s *podsServer) ListPods(context.Context, *podsv1alpha1.ListPodsRequest) (*podsv1alpha1.ListPodsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := &podsv1alpha1.ListPodsResponse{}
	for _, uid := range s.order {
		r.Pods = append(r.Pods, s.pods[uid])
	}
	return r, nil
}

func (s *podsServer) broadcast(ev *podsv1alpha1.WatchPodsEvent) {
	for ch := range s.watchers {
		ch <- ev
	}
}

// set adds or changes a pod; live streams see ADDED or MODIFIED unless quiet.
func (s *podsServer) set(t *testing.T, p *v1.Pod, quiet bool) {
	t.Helper()
	b, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	uid := string(p.UID)
	typ := podsv1alpha1.EventType_MODIFIED
	if _, ok := s.pods[uid]; !ok {
		s.order = append(s.order, uid)
		typ = podsv1alpha1.EventType_ADDED
	}
	s.pods[uid] = b
	if !quiet {
		s.broadcast(&podsv1alpha1.WatchPodsEvent{Type: typ, Pod: b})
	}
}

// del removes a pod; live streams see DELETED unless quiet.
func (s *podsServer) del(uid string, quiet bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.pods[uid]
	delete(s.pods, uid)
	s.order = slices.DeleteFunc(s.order, func(u string) bool { return u == uid })
	if !quiet {
		s.broadcast(&podsv1alpha1.WatchPodsEvent{Type: podsv1alpha1.EventType_DELETED, Pod: b})
	}
}

// breakStreams ends every open WatchPods stream with Unavailable, as a kubelet restart does.
func (s *podsServer) breakStreams() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch, kick := range s.watchers {
		close(kick)
		delete(s.watchers, ch)
	}
}

func (s *podsServer) streamCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.streams
}

// startPodsServer serves the Pods API on a unix socket (a short path: the 108-byte limit).
func startPodsServer(t *testing.T) (*podsServer, string, func()) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "ifl-ps-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "pods-api.sock")
	s := &podsServer{pods: map[string][]byte{}, watchers: map[chan *podsv1alpha1.WatchPodsEvent]chan struct{}{}}
	var srv *grpc.Server
	start := func() {
		_ = os.Remove(sock)
		ln, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		srv = grpc.NewServer()
		podsv1alpha1.RegisterPodsServer(srv, s)
		go func() { _ = srv.Serve(ln) }()
	}
	start()
	t.Cleanup(func() { srv.Stop() })
	// restart stops the server (every stream breaks, connects fail) for d, then serves again.
	restart := func() {
		srv.Stop()
		start()
	}
	return s, sock, restart
}

// countingPub passes events to the bus and counts them by action, to show what a resync published.
type countingPub struct {
	b  *bus.Bus
	mu sync.Mutex
	n  map[string]int
}

func (p *countingPub) PublishMsgs(ctx context.Context, msgs []bus.RawMsg) (uint64, error) {
	seq, err := p.b.PublishMsgs(ctx, msgs)
	if err == nil {
		p.mu.Lock()
		for _, m := range msgs {
			p.n[m.Header[events.HeaderType]]++
		}
		p.mu.Unlock()
	}
	return seq, err
}

// take returns the counts since the last take, by action.
func (p *countingPub) take() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for typ, n := range p.n {
		for _, a := range []string{events.ActionAdded, events.ActionUpdated, events.ActionDeleted} {
			if typ == events.TypeName(events.EntityPod, a) {
				out[a] += n
			}
		}
	}
	p.n = map[string]int{}
	return out
}

func apiPod(ns, name, uid string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), ResourceVersion: "1",
			Annotations: map[string]string{podindex.ConfigSourceAnnotationKey: podindex.ApiserverSource}},
		Spec:   v1.PodSpec{NodeName: testNode, Containers: []v1.Container{{Name: "app", Image: "registry.example/app:1"}}},
		Status: v1.PodStatus{Phase: v1.PodPending},
	}
}

// staticPod is a static pod as the Pods API shows it: UID = config.hash, config.source file.
func staticPod(name, hash string) *v1.Pod {
	p := apiPod("kube-system", name+"-"+testNode, hash)
	p.ResourceVersion = ""
	p.Annotations = map[string]string{podindex.ConfigSourceAnnotationKey: podindex.FileSource,
		podindex.ConfigHashAnnotationKey: hash, podindex.ConfigFirstSeenAnnotationKey: "2026-11-23T21:00:00Z"}
	return p
}

func startIndex(t *testing.T, b *bus.Bus) {
	t.Helper()
	ix, err := podindex.New(podindex.Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunFunc(t, "ix", ix.Run)
	select {
	case <-ix.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("pod index not ready after 15s")
	}
}

// indexUIDs lists the UIDs of the index's pods (non-mirror), sorted.
func indexUIDs(t testing.TB, b *bus.Bus) []string {
	t.Helper()
	var out []string
	q := events.PodsQuery{}
	for {
		var rep events.PodsReply
		if err := b.Request(context.Background(), events.QuerySubject(testNode, events.QryPods), q, &rep); err != nil {
			return []string{"error: " + err.Error()}
		}
		for _, raw := range rep.Pods {
			var p v1.Pod
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatal(err)
			}
			out = append(out, string(p.UID))
		}
		if !rep.Truncated {
			break
		}
		q.After = rep.Next
	}
	sort.Strings(out)
	return out
}

func waitUIDs(t *testing.T, b *bus.Bus, want ...string) {
	t.Helper()
	sort.Strings(want)
	bustest.Eventually(t, fmt.Sprintf("index pods %v", want), 15*time.Second, func() error {
		if got := indexUIDs(t, b); !slices.Equal(got, want) {
			return fmt.Errorf("index pods %v", got)
		}
		return nil
	})
}

// resyncs is how many replaces the kubelet sources of testNode began (the replace of a stream's initial set).
func resyncs() float64 { return testutil.ToFloat64(sourceResyncs.WithLabelValues(testNode, "kubelet")) }

// waitReplaced waits for f to begin a replace after resyncs() read before, then for it to end: a replace
// counts itself once it holds the feed's lock and publishes before it lets go, so what it published has
// been counted when waitReplaced returns.
func waitReplaced(t *testing.T, f *feed, before float64) {
	t.Helper()
	bustest.WaitFor(t, "the source to compare a new stream's pods with the index", func() bool { return resyncs() > before })
	f.mu.Lock()
	f.mu.Unlock() //nolint:staticcheck // an empty critical section: it waits for the replace holding the lock
}

func waitHealth(t *testing.T, what string, f func() error, healthy bool) {
	t.Helper()
	bustest.Eventually(t, fmt.Sprintf("%s: healthy=%v", what, healthy), 15*time.Second, func() error {
		if err := f(); (err == nil) != healthy {
			return fmt.Errorf("health %v", err)
		}
		return nil
	})
}

func wantCounts(t *testing.T, what string, got map[string]int, added, updated, deleted int) {
	t.Helper()
	want := map[string]int{}
	for a, n := range map[string]int{events.ActionAdded: added, events.ActionUpdated: updated, events.ActionDeleted: deleted} {
		if n > 0 {
			want[a] = n
		}
	}
	for a, n := range got {
		if n == 0 {
			delete(got, a)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%s: published %v, want %v", what, got, want)
	}
	for a, n := range want {
		if got[a] != n {
			t.Fatalf("%s: published %v, want %v", what, got, want)
		}
	}
}

// TestKubeletSource drives the Pods API source through a kubelet's life: the initial sync, changes, a
// broken stream and a kubelet restart with pods added and deleted meanwhile (one deletion, one addition,
// nothing else published), malformed pod bytes (skipped, counted, and no pod deleted on incomplete
// knowledge), and an agent restart (the new source resumes from the index: nothing published).
func TestKubeletSource(t *testing.T) {
	_, b := bustest.Start(t)
	startIndex(t, b)
	srv, sock, restart := startPodsServer(t)
	a, c, s := apiPod("ns1", "a", "uid-a"), apiPod("ns1", "c", "uid-c"), staticPod("etcd", "hash-s")
	srv.set(t, a, true)
	srv.set(t, s, true)
	pub := &countingPub{b: b, n: map[string]int{}}
	newSource := func() *KubeletSource {
		src, err := NewKubeletSource(KubeletConfig{Node: testNode, Socket: sock, RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond}, pub, b)
		if err != nil {
			t.Fatal(err)
		}
		return src
	}
	src := newSource()
	stop := bustest.RunFunc(t, "src", src.Run)
	waitUIDs(t, b, "uid-a", "hash-s")
	waitHealth(t, "first sync", src.Health, true)
	wantCounts(t, "first sync", pub.take(), 2, 0, 0)

	// Changes on the stream.
	a.Status.Phase = v1.PodRunning
	srv.set(t, a, false)
	srv.set(t, c, false)
	waitUIDs(t, b, "uid-a", "uid-c", "hash-s")
	srv.del("uid-c", false)
	waitUIDs(t, b, "uid-a", "hash-s")
	wantCounts(t, "changes", pub.take(), 1, 1, 1)

	// The stream breaks; a pod goes and another comes while the source is away (the kubelet restarted).
	srv.del("uid-a", true)
	srv.set(t, c, true)
	n := srv.streamCount()
	restart()
	waitUIDs(t, b, "uid-c", "hash-s")
	if srv.streamCount() <= n {
		t.Fatal("no new stream after the restart")
	}
	waitHealth(t, "after reconnect", src.Health, true)
	wantCounts(t, "resync after a reconnect", pub.take(), 1, 0, 1)

	// A reconnect with nothing changed publishes nothing.
	before := resyncs()
	srv.breakStreams()
	bustest.WaitFor(t, "the source to open a new stream", func() bool { return srv.streamCount() > n+1 })
	waitReplaced(t, src.feed, before)
	waitHealth(t, "after a broken stream", src.Health, true)
	wantCounts(t, "resync with nothing changed", pub.take(), 0, 0, 0)

	// The index loses the static pod (as if its event had been discarded from the stream before the index
	// read it): the next stream compares with the index, not with what the source published, and publishes
	// the pod again.
	lost, err := podindex.PodEventMsg(testNode, events.ActionDeleted, s, "", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.PublishMsgs(t.Context(), []bus.RawMsg{lost}); err != nil {
		t.Fatal(err)
	}
	waitUIDs(t, b, "uid-c")
	n = srv.streamCount()
	srv.breakStreams()
	waitUIDs(t, b, "uid-c", "hash-s")
	wantCounts(t, "repair of a lost pod", pub.take(), 1, 0, 0)

	// Bytes that are no pod: skipped and counted; the pod that went meanwhile stays (the set is incomplete).
	srv.mu.Lock()
	srv.junk = [][]byte{{0xff, 0xfe, 0x01}, []byte("not a pod")}
	srv.mu.Unlock()
	srv.del("uid-c", true)
	n = srv.streamCount()
	before = resyncs()
	srv.breakStreams()
	bustest.WaitFor(t, "the source to open a new stream", func() bool { return srv.streamCount() > n })
	waitReplaced(t, src.feed, before)
	waitHealth(t, "after malformed pods", src.Health, true)
	// The replace of the new stream published nothing, so no deletion can reach the index.
	if got := indexUIDs(t, b); !slices.Equal(got, []string{"hash-s", "uid-c"}) {
		t.Fatalf("with malformed pods in the initial set the index holds %v, want uid-c kept", got)
	}
	wantCounts(t, "resync with malformed pods", pub.take(), 0, 0, 0)

	// The agent restarts: the new source resumes from the index; the kubelet's set (junk gone) deletes c.
	stop()
	srv.mu.Lock()
	srv.junk = nil
	srv.mu.Unlock()
	src = newSource()
	bustest.RunFunc(t, "src", src.Run)
	waitUIDs(t, b, "hash-s")
	waitHealth(t, "after an agent restart", src.Health, true)
	wantCounts(t, "agent restart", pub.take(), 0, 0, 1)
}

// TestKubeletSourceUnreachable: with no kubelet the source says so (Health, metric) and publishes nothing;
// once the kubelet serves, it syncs.
func TestKubeletSourceUnreachable(t *testing.T) {
	_, b := bustest.Start(t)
	startIndex(t, b)
	dir, err := os.MkdirTemp("/tmp", "ifl-ps-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "pods-api.sock")
	src, err := NewKubeletSource(KubeletConfig{Node: testNode, Socket: sock, RetryMin: 20 * time.Millisecond, RetryMax: 50 * time.Millisecond}, b, b)
	if err != nil {
		t.Fatal(err)
	}
	connects := sourceErrors.WithLabelValues(testNode, "kubelet", "connect")
	failed := testutil.ToFloat64(connects)
	bustest.RunFunc(t, "src", src.Run)
	// The source is unhealthy from its start; after two failed connections it still is.
	bustest.WaitFor(t, "two failed connections", func() bool { return testutil.ToFloat64(connects) >= failed+2 })
	if err := src.Health(); err == nil {
		t.Fatal("healthy with no kubelet")
	} else {
		t.Logf("health without a kubelet: %v", err)
	}
	s := &podsServer{pods: map[string][]byte{}, watchers: map[chan *podsv1alpha1.WatchPodsEvent]chan struct{}{}}
	s.set(t, apiPod("ns1", "a", "uid-a"), true)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	podsv1alpha1.RegisterPodsServer(gs, s)
	go func() { _ = gs.Serve(ln) }()
	defer gs.Stop()
	waitUIDs(t, b, "uid-a")
	waitHealth(t, "kubelet up", src.Health, true)
}

func TestNewKubeletSourceValidates(t *testing.T) {
	_, b := bustest.Start(t)
	for _, tc := range []struct {
		name string
		cfg  KubeletConfig
		want string
	}{
		{"no node", KubeletConfig{}, "kubelet pod source: node name is required"},
		{"bad node", KubeletConfig{Node: "Node_1"}, `kubelet pod source: node name "Node_1"`},
		{"retry", KubeletConfig{Node: "n", RetryMin: time.Second, RetryMax: time.Millisecond}, "kubelet pod source: retry max 1ms is below retry min 1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewKubeletSource(tc.cfg, b, b)
			if err == nil || len(err.Error()) < len(tc.want) || err.Error()[:len(tc.want)] != tc.want {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
	if _, err := NewKubeletSource(KubeletConfig{Node: "n"}, nil, b); err == nil {
		t.Fatal("nil publisher accepted")
	}
}

// TestKubeletSourceRepairsAnIndexGap: while the pod index is down, the source publishes a new pod and the
// pods stream (capped at 256 KiB here) drops that event under other nodes' events. The restarted index
// counts a gap; the source sees the count in a pods reply, reconciles with the index and publishes the pod
// again.
func TestKubeletSourceRepairsAnIndexGap(t *testing.T) {
	srv := bustest.Server(t)
	b, err := bus.Connect(context.Background(), srv.ClientURL(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(context.Background(), bus.StreamsConfig{EventsMaxBytes: 256 << 10, PodsMaxBytes: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	ix, err := podindex.New(podindex.Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	stopIndex := bustest.RunFunc(t, "ix", ix.Run)
	ps, sock, _ := startPodsServer(t)
	ps.set(t, apiPod("ns1", "a", "uid-a"), true)
	src, err := NewKubeletSource(KubeletConfig{Node: testNode, Socket: sock, RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond, GapCheckPeriod: 50 * time.Millisecond}, b, b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunFunc(t, "src", src.Run)
	waitUIDs(t, b, "uid-a")
	bustest.WaitFor(t, "the source to read the index's gap count as its baseline", func() bool { return src.indexGaps.Load() != noGaps })

	stopIndex()
	ps.set(t, apiPod("ns1", "b", "uid-b"), false) // published while no index runs
	bustest.WaitFor(t, "pod b published", func() bool { return src.lastSeq.Load() >= 2 })
	seqB := src.lastSeq.Load()
	for i := 0; ; i++ {
		// The pods stream holds a subset of the events stream, so its sequence of pod b is at most seqB.
		info, err := b.Stream(context.Background(), events.PodsStream)
		if err != nil {
			t.Fatal(err)
		}
		if info.FirstSeq > seqB {
			break
		}
		var filler []bus.RawMsg
		for j := range 100 {
			m, err := podindex.PodEventMsg("other-node", events.ActionAdded, apiPod("ns", fmt.Sprintf("f-%d-%d", i, j), fmt.Sprintf("f-%d-%d", i, j)), "", time.Now())
			if err != nil {
				t.Fatal(err)
			}
			filler = append(filler, m)
		}
		if _, err := b.PublishMsgs(context.Background(), filler); err != nil {
			t.Fatal(err)
		}
	}
	ix2, err := podindex.New(podindex.Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunFunc(t, "ix2", ix2.Run)
	waitUIDs(t, b, "uid-a", "uid-b")
	if ix2.Gaps() != 1 {
		t.Fatalf("index gaps %d, want 1", ix2.Gaps())
	}
}
