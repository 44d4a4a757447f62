package podindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

const testNode = "node-a.example"

func TestNewValidatesConfig(t *testing.T) {
	_, b := bustest.Start(t)
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"no node", Config{}, "pod index: node name is required"},
		{"bad node", Config{Node: "Node_A"}, `pod index: node name "Node_A" is not a DNS-1123 subdomain`},
		{"negative flush", Config{Node: "n", FlushInterval: -time.Second}, "pod index: flush interval -1s must not be negative"},
		{"negative flush events", Config{Node: "n", FlushEvents: -1}, "pod index: flush events -1 must not be negative"},
		{"negative decode workers", Config{Node: "n", DecodeWorkers: -1}, "pod index: decode workers -1 must not be negative"},
		{"ok", Config{Node: "n"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, b)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want %q", err, tc.wantErr)
			}
		})
	}
	if _, err := New(Config{Node: "n"}, nil); err == nil {
		t.Fatal("nil bus accepted")
	}
}

// startBus starts a server and a connection whose lazily started goroutines (request mux, async publish
// acks) already run, so goleak sees only what the worker leaves.
func startBus(t *testing.T) *bus.Bus {
	t.Helper()
	_, b := bustest.Start(t)
	if _, err := b.PublishMsgs(t.Context(), []bus.RawMsg{{Subject: events.EventSubject("warm-up", "x", "y"), Data: []byte("{}")}}); err != nil {
		t.Fatal(err)
	}
	_ = b.Request(t.Context(), "warm.up", nil, nil)
	return b
}

func testPod(ns, name, uid string, secrets []string, cms []string, image string) *v1.Pod {
	p := &v1.Pod{
		TypeMeta:   metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid)},
		Spec:       v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: image}}},
		Status:     v1.PodStatus{Phase: v1.PodRunning},
	}
	for _, s := range secrets {
		p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: "s-" + s, VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: s}}})
	}
	for _, c := range cms {
		p.Spec.Containers[0].EnvFrom = append(p.Spec.Containers[0].EnvFrom, v1.EnvFromSource{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: c}}})
	}
	return p
}

func publish(t testing.TB, b *bus.Bus, node, action string, pods ...*v1.Pod) uint64 {
	t.Helper()
	msgs := make([]bus.RawMsg, 0, len(pods))
	for _, p := range pods {
		m, err := PodEventMsg(node, action, p, "", time.Now())
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	seq, err := b.PublishMsgs(context.Background(), msgs)
	if err != nil {
		t.Fatal(err)
	}
	return seq
}

func startService(t *testing.T, b *bus.Bus, cfg Config) (*Service, func()) {
	t.Helper()
	s, err := New(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	done, stop := runService(s)
	select {
	case <-s.Ready():
	case err := <-done:
		t.Fatalf("run: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("not ready after 15s")
	}
	return s, func() {
		if err := stop(); err != nil {
			t.Errorf("run returned %v", err)
		}
	}
}

// runService runs s until stop, which returns what Run returned; done delivers Run's result should it end
// first (then stop must not be called).
func runService(s *Service) (done <-chan error, stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- s.Run(ctx) }()
	return ran, func() error {
		cancel()
		return <-ran
	}
}

func TestServiceIndexesQueriesAndRestarts(t *testing.T) {
	b := startBus(t)
	defer goleak.VerifyNone(t, bustest.IgnoreServer(goleak.IgnoreCurrent())...)
	ctx := t.Context()
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 50 * time.Millisecond})

	web := testPod("prod", "web", "uid-web", []string{"tls", "db"}, []string{"cfg"}, "nginx:1.27")
	job := testPod("prod", "job", "uid-job", []string{"db"}, nil, "busybox:1")
	static := testPod("kube-system", "etcd-node-a", "uid-static", nil, nil, "etcd:3.5")
	static.Annotations = map[string]string{ConfigSourceAnnotationKey: "file", ConfigHashAnnotationKey: "h1"}
	mirror := testPod("kube-system", "etcd-node-a", "uid-mirror", nil, nil, "etcd:3.5")
	mirror.Annotations = map[string]string{ConfigSourceAnnotationKey: "api", ConfigMirrorAnnotationKey: "h1", ConfigHashAnnotationKey: "h1"}
	orphan := testPod("kube-system", "gone-node-a", "uid-orphan", nil, nil, "gone:1")
	orphan.Annotations = map[string]string{ConfigMirrorAnnotationKey: "h2"}

	// The mirror pod arrives before its static pod.
	publish(t, b, testNode, events.ActionAdded, web, job, mirror, orphan)
	publish(t, b, testNode, events.ActionAdded, static)
	jobDone := job.DeepCopy()
	jobDone.Status.Phase = v1.PodSucceeded
	last := publish(t, b, testNode, events.ActionUpdated, jobDone)
	bustest.WaitFor(t, "all applied", func() bool { return s.State().Applied() >= last })

	var refs events.RefsReply
	if err := b.Request(ctx, events.QuerySubject(testNode, events.QryRefs), nil, &refs); err != nil {
		t.Fatal(err)
	}
	wantRefs := []events.Ref{
		{Kind: "ConfigMap", Namespace: "prod", Name: "cfg", Count: 1},
		{Kind: "Secret", Namespace: "prod", Name: "db", Count: 1},
		{Kind: "Secret", Namespace: "prod", Name: "tls", Count: 1},
	}
	if !reflect.DeepEqual(refs.Refs, wantRefs) {
		t.Fatalf("refs = %+v\nwant %+v", refs.Refs, wantRefs)
	}

	queries := []struct {
		name         string
		q            events.PodsQuery
		wantPods     []string
		wantMirrors  []string
		wantOrphaned []string
	}{
		{"by mirror uid translates", events.PodsQuery{UID: "uid-mirror"}, []string{"uid-static"}, []string{"uid-mirror"}, nil},
		{"by name", events.PodsQuery{Namespace: "prod", Name: "web"}, []string{"uid-web"}, nil, nil},
		{"orphaned", events.PodsQuery{Orphaned: true}, nil, []string{"uid-orphan"}, []string{"gone-node-a_kube-system"}},
		{"all", events.PodsQuery{}, []string{"uid-static", "uid-job", "uid-web"}, []string{"uid-mirror", "uid-orphan"}, nil},
		{"unknown", events.PodsQuery{UID: "nope"}, nil, nil, nil},
	}
	for _, tc := range queries {
		t.Run(tc.name, func(t *testing.T) {
			var rep events.PodsReply
			if err := b.Request(ctx, events.QuerySubject(testNode, events.QryPods), tc.q, &rep); err != nil {
				t.Fatal(err)
			}
			if got := rawUIDs(t, rep.Pods); !reflect.DeepEqual(got, tc.wantPods) {
				t.Errorf("pods %v, want %v", got, tc.wantPods)
			}
			if got := rawUIDs(t, rep.MirrorPods); !reflect.DeepEqual(got, tc.wantMirrors) {
				t.Errorf("mirror pods %v, want %v", got, tc.wantMirrors)
			}
			if tc.wantOrphaned != nil && !reflect.DeepEqual(rep.OrphanedMirrorPods, tc.wantOrphaned) {
				t.Errorf("orphaned %v, want %v", rep.OrphanedMirrorPods, tc.wantOrphaned)
			}
			if rep.MirrorToPod["uid-mirror"] != "uid-static" || rep.PodToMirror["uid-static"] != "uid-mirror" {
				t.Errorf("translations %v %v", rep.MirrorToPod, rep.PodToMirror)
			}
		})
	}
	rep, err := b.RequestRaw(ctx, events.QuerySubject(testNode, events.QryPods), []byte(`{"uid":"a","orphaned":true}`))
	if err != nil || !strings.Contains(rep.Error, "not several") {
		t.Fatalf("bad query answered %+v, %v", rep, err)
	}

	var inuse events.InUseReply
	if err := b.Request(ctx, events.QuerySubject(testNode, events.QryInUse), nil, &inuse); err != nil {
		t.Fatal(err)
	}
	if want := []string{"etcd:3.5", "gone:1", "nginx:1.27"}; !reflect.DeepEqual(inuse.Images, want) {
		t.Fatalf("in use %v, want %v (the succeeded job's busybox is not)", inuse.Images, want)
	}

	// Registration events: tls, db, cfg registered by web; db registered by job then (job succeeded)... db is
	// still referenced by web, so only the 0 -> 1 transitions of web appear.
	bustest.WaitFor(t, "registration events", func() bool { return len(refEvents(t, b)) == 3 })
	got := refEvents(t, b)
	for _, want := range []string{"secret.registered prod/tls", "secret.registered prod/db", "configmap.registered prod/cfg"} {
		if !contains(got, want) {
			t.Errorf("registration events %v lack %q", got, want)
		}
	}

	before := snapshot(t, s.State())
	stop()

	// Restart the worker: the same state, from the snapshot (and nothing replayed twice).
	publish(t, b, testNode, events.ActionDeleted, web)
	s2, stop2 := startService(t, b, Config{Node: testNode, FlushInterval: 50 * time.Millisecond})
	defer stop2()
	bustest.WaitFor(t, "delete applied after restart", func() bool {
		_, ok := s2.State().Index.getPodByUID("uid-web")
		return !ok
	})
	after := snapshot(t, s2.State())
	if len(after.refs) != 0 {
		t.Fatalf("refs after deleting web: %+v", after.refs)
	}
	before.refs, after.refs = nil, nil
	delete(before.pods, "uid-web")
	if !reflect.DeepEqual(before.pods, after.pods) || !reflect.DeepEqual(before.mirrors, after.mirrors) {
		t.Fatalf("state after restart differs:\n%+v\n%+v", before, after)
	}
	bustest.WaitFor(t, "unregistration events", func() bool { return len(refEvents(t, b)) == 6 })
}

func TestMalformedEventsAreDeadLettered(t *testing.T) {
	b := startBus(t)
	defer goleak.VerifyNone(t, bustest.IgnoreServer(goleak.IgnoreCurrent())...)
	ctx := t.Context()
	s, stop := startService(t, b, Config{Node: testNode})
	defer stop()
	rejected := func(reason string) float64 {
		return testutil.ToFloat64(eventsRejected.WithLabelValues(testNode, reason))
	}
	base := map[string]float64{}
	for _, r := range []string{ReasonBadPod, ReasonNoUID, ReasonBadType} {
		base[r] = rejected(r)
	}
	subj := func(action string) string { return events.EventSubject(testNode, events.EntityPod, action) }
	bad := []bus.RawMsg{
		{Subject: subj(events.ActionAdded), Data: []byte(`{"metadata":`)},
		{Subject: subj(events.ActionAdded), Data: []byte(`{"metadata":{"name":"x","namespace":"ns"}}`)},
		{Subject: subj("exploded"), Data: []byte(`{"metadata":{"name":"x","namespace":"ns","uid":"u"}}`)},
		{Subject: subj(events.ActionAdded), Data: []byte(`{"kind":"Secret","metadata":{"name":"x","namespace":"ns","uid":"u"}}`)},
	}
	if _, err := b.PublishMsgs(ctx, bad); err != nil {
		t.Fatal(err)
	}
	good := testPod("ns", "ok", "uid-ok", nil, nil, "img:1")
	last := publish(t, b, testNode, events.ActionAdded, good)
	bustest.WaitFor(t, "the good event after the bad ones", func() bool { return s.State().Applied() >= last })
	if _, ok := s.State().Index.getPodByUID("uid-ok"); !ok {
		t.Fatal("the worker did not keep going after bad input")
	}
	dl, err := b.DeadLetters(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	for _, d := range dl {
		reasons = append(reasons, d.Reason)
	}
	want := []string{
		"malformed pod event: body is not a core/v1 Pod",
		"malformed pod event: pod ns/x has no metadata.uid",
		`malformed pod event: unknown pod event type "exploded"`,
		`malformed pod event: body is a "Secret", not a Pod`,
	}
	if len(reasons) != len(want) {
		t.Fatalf("dead letters %q, want %d", reasons, len(want))
	}
	for i := range want {
		if !strings.HasPrefix(reasons[i], want[i]) {
			t.Errorf("dead letter %d reason %q, want prefix %q", i, reasons[i], want[i])
		}
	}
	if got := rejected(ReasonBadPod) - base[ReasonBadPod]; got != 2 {
		t.Errorf("bad_pod counted %v, want 2", got)
	}
	if got := rejected(ReasonNoUID) - base[ReasonNoUID]; got != 1 {
		t.Errorf("no_uid counted %v, want 1", got)
	}
	if got := rejected(ReasonBadType) - base[ReasonBadType]; got != 1 {
		t.Errorf("bad_type counted %v, want 1", got)
	}
}

func FuzzDecodePodEvent(f *testing.F) {
	f.Add("added", "", []byte(`{"metadata":{"name":"a","namespace":"ns","uid":"u"}}`))
	f.Add("deleted", "imagefleet.pod.deleted.v1", []byte(`{"kind":"Pod","apiVersion":"v1","metadata":{"name":"a","namespace":"ns","uid":"u"},"spec":{"containers":[{"name":"c","image":"x"}]}}`))
	f.Add("updated", "x", []byte(`{"metadata":{"name":"a"}}`))
	f.Add("bogus", "", []byte(`null`))
	f.Fuzz(func(t *testing.T, action, ceType string, body []byte) {
		h := map[string][]string{}
		if ceType != "" {
			h["ce-type"] = []string{ceType}
		}
		ev, err := DecodePodEvent("imagefleet.evt.n.pod."+action, h, body)
		if err != nil {
			if !errors.Is(err, events.ErrMalformed) || rejectReason(err) == "other" {
				t.Fatalf("error %v is not a classified decodeError", err)
			}
			return
		}
		if ev.Pod == nil || ev.Pod.UID == "" || ev.Pod.Name == "" || ev.Pod.Namespace == "" {
			t.Fatalf("accepted an incomplete pod: %+v", ev.Pod)
		}
		// An accepted event applies without panicking and is undone by its delete.
		s := NewState()
		s.Apply(1, PodEvent{Action: events.ActionAdded, Pod: ev.Pod, Raw: ev.Raw})
		s.Apply(2, PodEvent{Action: events.ActionDeleted, Pod: ev.Pod})
		if p, m := s.Index.size(); p+m != 0 || len(s.Refs.Refs()) != 0 {
			t.Fatalf("add then delete left %d pods, %d mirrors, refs %v", p, m, s.Refs.Refs())
		}
	})
}

// stateSnap is a comparable view of a State.
type stateSnap struct {
	pods, mirrors map[string]string // uid -> ns/name
	refs          []events.Ref
	translations  map[string]string
}

func snapshot(t testing.TB, s *State) stateSnap {
	t.Helper()
	pods, mirrors, _ := s.Index.GetPodsAndMirrorPods()
	out := stateSnap{pods: map[string]string{}, mirrors: map[string]string{}, refs: s.Refs.Refs(), translations: map[string]string{}}
	for _, p := range pods {
		out.pods[string(p.UID)] = p.Namespace + "/" + p.Name + "/" + string(p.Status.Phase)
	}
	for _, p := range mirrors {
		out.mirrors[string(p.UID)] = p.Namespace + "/" + p.Name
	}
	_, m2p := s.Index.GetUIDTranslations()
	for k, v := range m2p {
		out.translations[string(k)] = string(v)
	}
	return out
}

func rawUIDs(t *testing.T, raws []json.RawMessage) []string {
	t.Helper()
	var out []string
	for _, r := range raws {
		var p v1.Pod
		if err := json.Unmarshal(r, &p); err != nil {
			t.Fatal(err)
		}
		out = append(out, string(p.UID))
	}
	return out
}

func refEvents(t testing.TB, b *bus.Bus) []string {
	t.Helper()
	var out []string
	for _, entity := range []string{events.EntitySecret, events.EntityConfigMap} {
		err := b.Read(context.Background(), events.EventsStream, events.EventSubject(testNode, entity, "*"), func(m bus.StreamMsg) error {
			ev, err := events.DecodeEvent(m.Data)
			if err != nil {
				t.Errorf("decode %s: %v", m.Subject, err)
				return bus.StopReading
			}
			var rc events.RefChange
			if err := ev.DecodeData(&rc); err != nil {
				t.Errorf("decode %s data: %v", m.Subject, err)
				return bus.StopReading
			}
			entity, action, _, _ := events.ParseType(ev.Type)
			out = append(out, entity+"."+action+" "+rc.Namespace+"/"+rc.Name)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// TestPodsListingPages: a listing is the pods, then the mirror pods, each sorted; Offset and Limit page
// through it, and a page stops before events.MaxPodsPageBytes of pod JSON, so paging with Next returns
// every pod once, in order; Source keeps the pods of one config source.
func TestPodsListingPages(t *testing.T) {
	st := NewState()
	note := strings.Repeat("n", 4000)
	var seq uint64
	var want []string
	for k := range 300 {
		p := testPod("ns", fmt.Sprintf("p-%03d", k), fmt.Sprintf("uid-%03d", k), nil, nil, "img:1")
		p.Annotations = map[string]string{"note": note}
		if k%100 == 0 {
			p.Annotations[ConfigSourceAnnotationKey] = FileSource
		}
		seq++
		st.Apply(seq, PodEvent{Action: events.ActionAdded, Pod: p})
		want = append(want, p.Name)
	}
	for k := range 3 {
		m := testPod("ns", fmt.Sprintf("m-%d", k), fmt.Sprintf("uid-m-%d", k), nil, nil, "img:1")
		m.Annotations = map[string]string{ConfigMirrorAnnotationKey: "h"}
		seq++
		st.Apply(seq, PodEvent{Action: events.ActionAdded, Pod: m})
		want = append(want, m.Name)
	}
	names := func(rep events.PodsReply) []string {
		var out []string
		for _, raw := range append(append([]json.RawMessage{}, rep.Pods...), rep.MirrorPods...) {
			var p v1.Pod
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatal(err)
			}
			out = append(out, p.Name)
		}
		return out
	}

	var got []string
	pages := 0
	for q := (events.PodsQuery{}); ; pages++ {
		rep, err := st.listPods(testNode, q)
		if err != nil {
			t.Fatal(err)
		}
		size := 0
		for _, raw := range append(append([]json.RawMessage{}, rep.Pods...), rep.MirrorPods...) {
			size += len(raw)
		}
		if size > events.MaxPodsPageBytes || len(rep.Pods)+len(rep.MirrorPods) == 0 {
			t.Fatalf("page %d carries %d entries, %d bytes of pods (at most %d)", pages, len(rep.Pods)+len(rep.MirrorPods), size, events.MaxPodsPageBytes)
		}
		got = append(got, names(rep)...)
		if !rep.Truncated {
			if rep.Next != "" {
				t.Fatalf("last page says next %q", rep.Next)
			}
			break
		}
		q.After = rep.Next
	}
	if pages < 2 || !slices.Equal(got, want) {
		t.Fatalf("%d pages gave %d entries, want every one of %d once and in order (pods, then mirror pods)", pages+1, len(got), len(want))
	}

	// Limit, and a page after a token, across the pods-to-mirrors boundary.
	rep, err := st.listPods(testNode, events.PodsQuery{Limit: 298})
	if err != nil || len(rep.Pods) > 298 {
		t.Fatalf("limit 298: %d pods, %v", len(rep.Pods), err)
	}
	for len(got) > 0 && rep.Truncated && len(rep.Pods) < 298 { // the byte bound cut it: go on to 298
		more, err := st.listPods(testNode, events.PodsQuery{After: rep.Next, Limit: 298 - len(rep.Pods)})
		if err != nil {
			t.Fatal(err)
		}
		rep.Pods, rep.Next, rep.Truncated = append(rep.Pods, more.Pods...), more.Next, more.Truncated
	}
	after298 := rep.Next
	rep, err = st.listPods(testNode, events.PodsQuery{After: after298, Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	if g := names(rep); !slices.Equal(g, []string{"p-298", "p-299", "m-0"}) || !rep.Truncated {
		t.Fatalf("after the 298th, limit 3: %v truncated %v", g, rep.Truncated)
	}
	// Pods deleted and added between pages shift nothing: the next page starts after the token's key.
	seq++
	st.Apply(seq, PodEvent{Action: events.ActionDeleted, Pod: testPod("ns", "p-297", "uid-297", nil, nil, "img:1")})
	seq++
	st.Apply(seq, PodEvent{Action: events.ActionAdded, Pod: testPod("aa", "first", "uid-first", nil, nil, "img:1")})
	rep, err = st.listPods(testNode, events.PodsQuery{After: after298, Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if g := names(rep); !slices.Equal(g, []string{"p-298"}) {
		t.Fatalf("after the 298th once the listing changed before it: %v, want [p-298]", g)
	}

	rep, err = st.listPods(testNode, events.PodsQuery{Source: FileSource})
	if err != nil {
		t.Fatal(err)
	}
	if g := names(rep); !slices.Equal(g, []string{"p-000", "p-100", "p-200"}) || rep.Truncated {
		t.Fatalf("source file: %v truncated %v", g, rep.Truncated)
	}
	if _, err := st.listPods(testNode, events.PodsQuery{After: "bm90IGEgdG9rZW4"}); err == nil || !errors.Is(err, events.ErrMalformed) {
		t.Fatalf("a bad token: %v", err)
	}
	for _, bad := range []events.PodsQuery{{Limit: -1}, {UID: "u", After: "x"}, {Namespace: "ns", Name: "a", Source: "file"}, {Orphaned: true, Source: "file"}} {
		if bad.Validate() == nil {
			t.Errorf("query %+v accepted", bad)
		}
	}
	if (events.PodsQuery{UID: "u", Limit: 5}).Validate() != nil {
		t.Error("a selected pod with a limit (older clients send it) is refused")
	}
}

// TestQueriesWaitForCatchUp: until the index has applied the events its stream held when it started, the
// queries answer that it is catching up (GC then removes nothing rather than trust a state missing pods);
// once Ready, they answer with every one of those events applied.
func TestQueriesWaitForCatchUp(t *testing.T) {
	b := startBus(t)
	var pods []*v1.Pod
	for k := range 3000 {
		pods = append(pods, testPod("ns", fmt.Sprintf("p-%d", k), fmt.Sprintf("uid-%d", k), nil, nil, fmt.Sprintf("img:%d", k)))
	}
	last := publish(t, b, testNode, events.ActionAdded, pods...)

	s, err := New(Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	for name, h := range map[string]bus.Handler{"pods": s.handlePods, "refs": s.handleRefs, "inuse": s.handleInUse} {
		if _, err := h(t.Context(), nil); err == nil || !strings.Contains(err.Error(), events.ErrIndexCatchingUp.Error()) {
			t.Fatalf("%s before catching up: %v, want %q", name, err, events.ErrIndexCatchingUp)
		}
	}
	_, stop := runService(s)
	defer func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	}()
	// Ask over NATS while it catches up: every answer is either "catching up" or the whole state.
	bustest.Eventually(t, "the in-use query answered", bustest.Timeout, func() error {
		var inuse events.InUseReply
		err := b.Request(t.Context(), events.QuerySubject(testNode, events.QryInUse), nil, &inuse)
		if err == nil {
			if len(inuse.Images) != len(pods) {
				t.Fatalf("answered with %d images in use before catching up, want %d", len(inuse.Images), len(pods))
			}
			return nil
		}
		if !IsCatchingUp(err) && !errors.Is(err, bus.ErrNoResponders) {
			t.Fatal(err)
		}
		return err
	})
	select {
	case <-s.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("not ready after 15s")
	}
	if s.State().Applied() < last {
		t.Fatalf("ready at %d, before the last event %d held at start", s.State().Applied(), last)
	}
}

// TestRunReturnsWhenTheSnapshotDoesNotLoad: the queries are served before the snapshot loads; a snapshot
// that does not load ends Run with its error, the query goroutines with it.
func TestRunReturnsWhenTheSnapshotDoesNotLoad(t *testing.T) {
	b := startBus(t)
	store, err := OpenStore(t.Context(), b, testNode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.kv.Put(t.Context(), store.appliedKey(), []byte("not a number")); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Node: testNode}, b)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Run(t.Context()) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "applied sequence") {
			t.Fatalf("run: %v, want the snapshot's error", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after the snapshot failed to load")
	}
}
