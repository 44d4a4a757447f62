package integration_test

import (
	"context"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"log/slog"
	"math/rand/v2"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
	"github.com/imagefleet/imagefleet/services/podindex"
)

// TestPodIndexSurvivesNATSAndWorkerRestarts streams pod events through a real nats-server, restarts the
// server (same store, same port) while the index applies them, kills the index without its final flush,
// publishes while it is down, starts a new one, and checks that the final index and counts equal those of a
// fresh in-memory index fed the same events.
func TestPodIndexSurvivesNATSAndWorkerRestarts(t *testing.T) {
	const node = "node-int.example"
	dir := t.TempDir()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: fmt.Sprintf("127.0.0.1:%d", testport.Free(t)), StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	url := srv.ClientURL()
	defer func() { srv.Shutdown() }()
	ctx := t.Context()
	log := slog.New(slog.NewTextHandler(piLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	connect := func(name string) *bus.Bus {
		b, err := bus.Connect(ctx, url, bus.Options{Name: name, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	pubBus := connect("publisher")
	defer pubBus.Close()
	if err := pubBus.EnsureStreams(ctx, bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}

	msgs := piEventStream(node, 3000, rand.New(rand.NewPCG(7, 11)))
	expected := podindex.NewState()
	for i, m := range msgs {
		ev, err := podindex.DecodePodEvent(m.Subject, nil, m.Data)
		if err != nil {
			t.Fatalf("generated event %d is malformed: %v", i, err)
		}
		expected.Apply(uint64(i+1), ev)
	}
	var lastSeq uint64
	publish := func(batch []bus.RawMsg) {
		t.Helper()
		bustest.Eventually(t, "the batch published", 30*time.Second, func() error {
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			seq, err := pubBus.PublishMsgs(pctx, batch)
			if err == nil {
				lastSeq = max(lastSeq, seq)
			}
			return err
		})
	}
	start := func(name string) (*podindex.Service, *bus.Bus, context.CancelFunc, chan error) {
		b := connect(name)
		s, err := podindex.New(podindex.Config{Node: node, FlushInterval: 20 * time.Millisecond, FlushEvents: 100, Logger: log}, b)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- s.Run(rctx) }()
		return s, b, cancel, done
	}

	// 1. The index runs; the first third is published.
	s1, b1, cancel1, done1 := start("index-1")
	publish(msgs[:1000])
	bustest.WaitWithin(t, "some of the first third applied", time.Minute, func() bool { return s1.State().Applied() > 0 })

	// 2. NATS restarts (same store, same port) while the index is busy; the second third follows.
	srv.Shutdown()
	srv, err = bus.StartServer(bus.ServerConfig{Listen: strings.TrimPrefix(url, "nats://"), StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	publish(msgs[1000:2000])
	bustest.WaitWithin(t, "the second third applied", time.Minute, func() bool { return s1.State().Applied() >= lastSeq })

	// 3. The index is killed: its connection goes first, so its final flush fails (as a crash). The last
	//    third is published while it is down.
	publish(msgs[2000:2500])
	b1.Close()
	cancel1()
	if err := <-done1; err != nil {
		t.Fatalf("index 1: %v", err)
	}
	publish(msgs[2500:])

	// 4. A new index starts from the snapshot and the stream.
	s2, b2, cancel2, done2 := start("index-2")
	defer func() {
		cancel2()
		if err := <-done2; err != nil {
			t.Errorf("index 2: %v", err)
		}
		b2.Close()
	}()
	bustest.WaitWithin(t, "every event applied after the restarts", time.Minute, func() bool { return s2.State().Applied() >= lastSeq })

	want, got := piDescribe(expected), piDescribe(s2.State())
	if !reflect.DeepEqual(want, got) {
		for _, k := range []string{"pods", "mirrors", "byFullName", "translations", "refs", "inuse"} {
			if !reflect.DeepEqual(want[k], got[k]) {
				t.Errorf("%s differ:\nwant %v\ngot  %v", k, want[k], got[k])
			}
		}
		t.FailNow()
	}
	if len(want["pods"]) < 20 || len(want["refs"]) < 10 || len(want["translations"]) == 0 {
		t.Fatalf("the event stream is too trivial to prove anything: %d pods, %d refs, %d translations",
			len(want["pods"]), len(want["refs"]), len(want["translations"]))
	}
	// The counts over NATS are the same too.
	var refs events.RefsReply
	if err := pubBus.Request(ctx, events.QuerySubject(node, events.QryRefs), nil, &refs); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(refs.Refs, expected.Refs.Refs()) {
		t.Fatalf("refs query differs from the expected counts")
	}
	t.Logf("%d events, %d pods, %d mirror pods, %d refs, %d translations", len(msgs), len(want["pods"]),
		len(want["mirrors"]), len(want["refs"]), len(want["translations"]))
}

// piEventStream generates n pod events over a pool of pods: adds, updates with changing secret and
// configmap references and phases, deletes, static pods with mirror pods arriving in either order, orphaned
// mirrors, and pods recreated under the same name with a new UID.
func piEventStream(node string, n int, rng *rand.Rand) []bus.RawMsg {
	type slot struct {
		pod   *v1.Pod
		alive bool
	}
	slots := make([]slot, 120)
	gen := 0
	newPod := func(i int) *v1.Pod {
		gen++
		ns := fmt.Sprintf("ns-%d", i%4)
		name := fmt.Sprintf("pod-%d", i/2) // two slots share each full name: recreated pods
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(fmt.Sprintf("uid-%d-%d", i, gen))}}
		switch {
		case i%10 == 0: // a static pod
			p.Annotations = map[string]string{podindex.ConfigSourceAnnotationKey: "file", podindex.ConfigHashAnnotationKey: "h"}
		case i%10 == 1: // the mirror of the static pod of slot i-1 (same full name)
			p.Name = fmt.Sprintf("pod-%d", (i-1)/2)
			p.Namespace = fmt.Sprintf("ns-%d", (i-1)%4)
			p.Annotations = map[string]string{podindex.ConfigSourceAnnotationKey: "api", podindex.ConfigMirrorAnnotationKey: "h"}
		}
		return p
	}
	mutate := func(p *v1.Pod) {
		p.Spec = v1.PodSpec{}
		for range rng.IntN(3) {
			p.Spec.ImagePullSecrets = append(p.Spec.ImagePullSecrets, v1.LocalObjectReference{Name: fmt.Sprintf("pull-%d", rng.IntN(5))})
		}
		c := v1.Container{Name: "c", Image: fmt.Sprintf("img-%d:1", rng.IntN(30))}
		for range rng.IntN(4) {
			c.EnvFrom = append(c.EnvFrom, v1.EnvFromSource{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("s-%d", rng.IntN(15))}}})
		}
		for range rng.IntN(3) {
			c.Env = append(c.Env, v1.EnvVar{Name: "x", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cm-%d", rng.IntN(8))}}}})
		}
		p.Spec.Containers = []v1.Container{c}
		if rng.IntN(3) == 0 {
			p.Spec.Volumes = []v1.Volume{{Name: "v", VolumeSource: v1.VolumeSource{Projected: &v1.ProjectedVolumeSource{Sources: []v1.VolumeProjection{
				{Secret: &v1.SecretProjection{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("s-%d", rng.IntN(15))}}},
				{ConfigMap: &v1.ConfigMapProjection{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cm-%d", rng.IntN(8))}}},
			}}}}}
		}
		switch r := rng.IntN(10); {
		case r == 0:
			p.Status.Phase = v1.PodSucceeded
		case r == 1:
			p.Status.Phase = v1.PodFailed
		default:
			p.Status.Phase = v1.PodRunning
		}
	}
	var out []bus.RawMsg
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := 0; len(out) < n; i++ {
		k := rng.IntN(len(slots))
		s := &slots[k]
		action := events.ActionUpdated
		switch {
		case !s.alive:
			s.pod, s.alive, action = newPod(k), true, events.ActionAdded
			mutate(s.pod)
		case rng.IntN(6) == 0:
			s.alive, action = false, events.ActionDeleted
		default:
			s.pod = s.pod.DeepCopy()
			mutate(s.pod)
		}
		m, err := podindex.PodEventMsg(node, action, s.pod, fmt.Sprintf("ev-%d", i), at.Add(time.Duration(i)*time.Millisecond))
		if err != nil {
			panic(err)
		}
		out = append(out, m)
	}
	return out
}

// piDescribe is a comparable description of a pod index state.
func piDescribe(s *podindex.State) map[string][]string {
	pods, mirrors, orphans := s.Index.GetPodsAndMirrorPods()
	out := map[string][]string{}
	for _, p := range pods {
		out["pods"] = append(out["pods"], fmt.Sprintf("%s %s/%s %s %d", p.UID, p.Namespace, p.Name, p.Status.Phase, len(p.Spec.Containers[0].EnvFrom)))
		if q, ok := s.Index.GetPodByFullName(podindex.PodFullName(p)); ok {
			out["byFullName"] = append(out["byFullName"], podindex.PodFullName(p)+" "+string(q.UID))
		}
	}
	for _, p := range mirrors {
		out["mirrors"] = append(out["mirrors"], fmt.Sprintf("%s %s/%s", p.UID, p.Namespace, p.Name))
	}
	out["orphans"] = orphans
	p2m, m2p := s.Index.GetUIDTranslations()
	for k, v := range p2m {
		out["translations"] = append(out["translations"], "p2m "+string(k)+" "+string(v))
	}
	for k, v := range m2p {
		out["translations"] = append(out["translations"], "m2p "+string(k)+" "+string(v))
	}
	for _, r := range s.Refs.Refs() {
		out["refs"] = append(out["refs"], fmt.Sprintf("%s %s/%s %d", r.Kind, r.Namespace, r.Name, r.Count))
	}
	out["inuse"] = s.InUseImages()
	for k := range out {
		sort.Strings(out[k])
	}
	return out
}

type piLogWriter struct{ t *testing.T }

func (w piLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
