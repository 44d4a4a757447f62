package integration_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/puller"
)

const pullNode = "pull-node"

// pullCountingRuntime is the CRI client with the pulls in flight counted at the client: what the node's
// token limit must bound.
type pullCountingRuntime struct {
	*cri.Client
	inFlight, maxInFlight, pulls atomic.Int64
}

func (r *pullCountingRuntime) PullImage(ctx context.Context, ref string, auth *cri.AuthConfig, sb *cri.SandboxConfig, ann map[string]string) (string, error) {
	r.pulls.Add(1)
	n := r.inFlight.Add(1)
	defer r.inFlight.Add(-1)
	for {
		m := r.maxInFlight.Load()
		if n <= m || r.maxInFlight.CompareAndSwap(m, n) {
			break
		}
	}
	return r.Client.PullImage(ctx, ref, auth, sb, ann)
}

// pullStartPuller runs a puller of pullNode until the test ends or stop is called.
func pullStartPuller(t testing.TB, b *bus.Bus, rt interface {
	ImageStatus(context.Context, string) (cri.Image, error)
	PullImage(context.Context, string, *cri.AuthConfig, *cri.SandboxConfig, map[string]string) (string, error)
}, cfg puller.Config) (stop func()) {
	t.Helper()
	cfg.Node = pullNode
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Registerer = prometheus.NewRegistry()
	s, err := puller.New(cfg, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("puller: Run = %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("puller: Run did not return after cancel")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func pullSubscribe(t testing.TB, b *bus.Bus) *bus.Subscription {
	t.Helper()
	sub, err := b.SubscribeSync(t.Context(), events.EventSubject(pullNode, events.EntityPull, "*"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return sub
}

func pullPublish(t testing.TB, b *bus.Bus, req events.PullRequest) {
	t.Helper()
	if req.ID == "" {
		req.ID = events.NewID()
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := puller.Enqueue(ctx, b, pullNode, req); err != nil {
		t.Fatalf("publish pull %s: %v", req.ID, err)
	}
}

type pullOutcome struct {
	ev events.Event
	r  events.PullResult
}

// pullResults waits for the terminal result of every id.
func pullResults(t testing.TB, sub *bus.Subscription, timeout time.Duration, ids ...string) map[string]pullOutcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := map[string]pullOutcome{}
	for len(out) < len(want) {
		_, data, err := sub.Next(ctx)
		if err != nil {
			t.Fatalf("waiting for pull results: %v (have %d of %d)", err, len(out), len(want))
		}
		ev, err := events.DecodeEvent(data)
		if err != nil {
			t.Fatal(err)
		}
		var r events.PullResult
		if err := ev.DecodeData(&r); err != nil {
			t.Fatal(err)
		}
		if want[r.RequestID] && ev.Type != events.TypeName(events.EntityPull, events.ActionPulling) {
			out[r.RequestID] = pullOutcome{ev: ev, r: r}
		}
	}
	return out
}

func TestPullLandsInContainerd(t *testing.T) {
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	ctrd := lab.StartContainerd(t, lab.Options{})
	p, err := lab.Push(t.Context(), reg.Host(), "lab/app:1", 256<<10)
	if err != nil {
		t.Fatal(err)
	}
	_, b := bustest.Start(t)
	pullStartPuller(t, b, ctrd.Client(), puller.Config{})
	sub := pullSubscribe(t, b)
	pod := &events.PodRef{Namespace: "default", Name: "web", UID: "uid-web"}

	pullPublish(t, b, events.PullRequest{ID: "first", Image: p.Ref, Policy: events.PullIfNotPresent, Pod: pod})
	o := pullResults(t, sub, time.Minute, "first")["first"]
	if o.r.Error != "" || o.r.ImageRef != p.ID || !o.r.Pulled || o.ev.Reason != "Pulled" ||
		!strings.HasPrefix(o.ev.Message, fmt.Sprintf("Successfully pulled image %q in ", p.Ref)) {
		t.Fatalf("first pull: %+v %s %q", o.r, o.ev.Reason, o.ev.Message)
	}
	im, err := ctrd.Client().ImageStatus(t.Context(), p.Ref)
	if err != nil || im.ID != p.ID {
		t.Fatalf("containerd image status: %+v %v, want id %s", im, err, p.ID)
	}
	if o.r.ImageSize == 0 {
		t.Errorf("no image size in the result")
	}

	pullPublish(t, b, events.PullRequest{ID: "second", Image: p.Ref, Policy: events.PullIfNotPresent, Pod: pod})
	o = pullResults(t, sub, time.Minute, "second")["second"]
	if o.r.Error != "" || o.r.Pulled || o.ev.Message != fmt.Sprintf("Container image %q already present on machine and can be accessed by the pod", p.Ref) {
		t.Fatalf("second request: %+v %q", o.r, o.ev.Message)
	}

	// A missing image: the registry's answer, classified as the kubelet does.
	pullPublish(t, b, events.PullRequest{ID: "missing", Image: reg.Ref("lab/nope:1"), Policy: events.PullIfNotPresent, Pod: pod})
	o = pullResults(t, sub, time.Minute, "missing")["missing"]
	if o.r.Error != events.ErrKindImagePull || o.ev.Reason != "Failed" || o.ev.Severity != events.Warning {
		t.Fatalf("missing image: %+v %s", o.r, o.ev.Reason)
	}
	pullPublish(t, b, events.PullRequest{ID: "missing-again", Image: reg.Ref("lab/nope:1"), Policy: events.PullIfNotPresent, Pod: pod})
	o = pullResults(t, sub, time.Minute, "missing-again")["missing-again"]
	if o.r.Error != events.ErrKindImagePullBackOff || !strings.HasPrefix(o.r.Message, fmt.Sprintf("Back-off pulling image %q: ErrImagePull: ", reg.Ref("lab/nope:1"))) {
		t.Fatalf("backoff: %+v", o.r)
	}
}

// TestPullTokensTwoReplicas: --max-parallel-image-pulls 3 and two replicas of the node's puller against a
// slow registry: never more than 3 pulls at once, counted at the registry (repositories being read) and at
// the CRI client.
func TestPullTokensTwoReplicas(t *testing.T) {
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	ctrd := lab.StartContainerd(t, lab.Options{})
	const n = 9
	var refs []string
	for i := range n {
		p, err := lab.Push(t.Context(), reg.Host(), fmt.Sprintf("lab/tok%d:1", i), 64<<10)
		if err != nil {
			t.Fatal(err)
		}
		refs = append(refs, p.Ref)
	}
	reg.ResetStats()
	reg.SetDelay(400 * time.Millisecond)
	_, b := bustest.Start(t)
	rt := &pullCountingRuntime{Client: ctrd.Client()}
	three := int32(3)
	pullStartPuller(t, b, rt, puller.Config{MaxParallelImagePulls: &three})
	pullStartPuller(t, b, rt, puller.Config{MaxParallelImagePulls: &three})
	sub := pullSubscribe(t, b)
	var ids []string
	for i, ref := range refs {
		id := fmt.Sprintf("tok-%d", i)
		ids = append(ids, id)
		pullPublish(t, b, events.PullRequest{ID: id, Image: ref, Policy: events.PullAlways})
	}
	for id, o := range pullResults(t, sub, 3*time.Minute, ids...) {
		if o.r.Error != "" {
			t.Errorf("%s: %s %s", id, o.r.Error, o.r.Message)
		}
	}
	st := reg.Stats()
	t.Logf("registry: max repositories read at once %d, max reads at once %d; CRI client: max pulls at once %d of %d",
		st.MaxReposInFlight, st.MaxInFlight, rt.maxInFlight.Load(), rt.pulls.Load())
	if st.MaxReposInFlight > 3 || rt.maxInFlight.Load() > 3 {
		t.Fatalf("more than 3 pulls at once: registry %d, CRI client %d", st.MaxReposInFlight, rt.maxInFlight.Load())
	}
	if rt.maxInFlight.Load() < 2 {
		t.Errorf("pulls never overlapped (max %d): the tokens were not used", rt.maxInFlight.Load())
	}
	for _, ref := range refs {
		if _, err := ctrd.Client().ImageStatus(t.Context(), ref); err != nil {
			t.Errorf("%s not in containerd: %v", ref, err)
		}
	}
}

const pullSecretManifest = `{"apiVersion":"v1","kind":"Secret","metadata":{"name":"regcred","namespace":"team-a","uid":"sec-uid-1"},
"type":"kubernetes.io/dockerconfigjson","data":{".dockerconfigjson":%q}}`

// TestPullBasicAuth: a registry with basic auth accepts the pod's pull secret; a pod without it can
// neither pull the image nor use the copy pulled with the secret (KEP-2535); no credential shows up in an
// event or a log.
func TestPullBasicAuth(t *testing.T) {
	const user, pass = "alice", "pa55-w0rd-integration"
	reg := lab.StartRegistry(t, lab.RegistryOptions{User: user, Password: pass})
	ctrd := lab.StartContainerd(t, lab.Options{})
	p, err := lab.Push(t.Context(), reg.Host(), "private/app:1", 128<<10, lab.WithAuth(user, pass))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cfgJSON := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, reg.Host(), base64.StdEncoding.EncodeToString([]byte(user+":"+pass)))
	manifest := fmt.Sprintf(pullSecretManifest, base64.StdEncoding.EncodeToString([]byte(cfgJSON)))
	if err := os.WriteFile(filepath.Join(dir, "regcred.json"), []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bustest.SyncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, b := bustest.Start(t)
	pullStartPuller(t, b, ctrd.Client(), puller.Config{PullSecretsDir: dir, Logger: log})
	sub := pullSubscribe(t, b)
	podA := &events.PodRef{Namespace: "team-a", Name: "a", UID: "uid-a"}
	podB := &events.PodRef{Namespace: "team-b", Name: "b", UID: "uid-b"}

	pullPublish(t, b, events.PullRequest{ID: "b-first", Image: p.Ref, Policy: events.PullIfNotPresent, Pod: podB})
	if o := pullResults(t, sub, time.Minute, "b-first")["b-first"]; o.r.Error != events.ErrKindImagePull {
		t.Fatalf("pod without the secret: %+v", o.r)
	}
	pullPublish(t, b, events.PullRequest{ID: "a", Image: p.Ref, Policy: events.PullIfNotPresent, Pod: podA, Secrets: []string{"regcred"}})
	if o := pullResults(t, sub, time.Minute, "a")["a"]; o.r.Error != "" || o.r.ImageRef != p.ID {
		t.Fatalf("pod with the secret: %+v", o.r)
	}
	pullPublish(t, b, events.PullRequest{ID: "b-never", Image: p.Ref, Policy: events.PullNever, Pod: podB})
	if o := pullResults(t, sub, time.Minute, "b-never")["b-never"]; o.r.Error != events.ErrKindImageNeverPull ||
		o.r.Message != fmt.Sprintf("Container image %q is not present with pull policy of Never", p.Ref) {
		t.Fatalf("pod b, Never, image present but not its own: %+v", o.r)
	}
	pullPublish(t, b, events.PullRequest{ID: "b-ifnotpresent", Image: p.Ref, Policy: events.PullIfNotPresent, Pod: &events.PodRef{Namespace: "team-b", Name: "b2", UID: "uid-b2"}})
	if o := pullResults(t, sub, time.Minute, "b-ifnotpresent")["b-ifnotpresent"]; o.r.Error != events.ErrKindImagePull {
		t.Fatalf("pod b, IfNotPresent, image present but not its own: %+v, want a pull refused by the registry", o.r)
	}
	pullPublish(t, b, events.PullRequest{ID: "a-again", Image: p.Ref, Policy: events.PullNever, Pod: podA, Secrets: []string{"regcred"}})
	if o := pullResults(t, sub, time.Minute, "a-again")["a-again"]; o.r.Error != "" {
		t.Fatalf("pod a, Never, after its pull: %+v", o.r)
	}
	if reg.Stats().Unauthorized == 0 {
		t.Error("the registry never refused anyone")
	}
	var stored bytes.Buffer
	if err := b.Read(t.Context(), events.EventsStream, "", func(m bus.StreamMsg) error {
		stored.Write(m.Data)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	enc := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	for where, text := range map[string]string{"events": stored.String(), "logs": logs.String()} {
		if strings.Contains(text, pass) || strings.Contains(text, enc) {
			t.Errorf("the password is in the %s", where)
		}
	}
}

// TestPullSurvivesRestart: a puller stopped in the middle of a slow pull hands the request back; the next
// one completes it, and the image is in containerd.
func TestPullSurvivesRestart(t *testing.T) {
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	ctrd := lab.StartContainerd(t, lab.Options{})
	p, err := lab.Push(t.Context(), reg.Host(), "lab/slow:1", 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	reg.SetDelay(3 * time.Second)
	_, b := bustest.Start(t)
	rt := &pullCountingRuntime{Client: ctrd.Client()}
	stop := pullStartPuller(t, b, rt, puller.Config{})
	sub := pullSubscribe(t, b)
	pullPublish(t, b, events.PullRequest{ID: "restart", Image: p.Ref, Policy: events.PullIfNotPresent})
	bustest.WaitWithin(t, "the pull to start", 30*time.Second, func() bool { return rt.inFlight.Load() != 0 })
	stop()
	reg.SetDelay(0)
	pullStartPuller(t, b, rt, puller.Config{})
	o := pullResults(t, sub, 2*time.Minute, "restart")["restart"]
	if o.r.Error != "" || o.r.Deliveries != 2 || o.r.ImageRef != p.ID {
		t.Fatalf("after restart: %+v", o.r)
	}
	if _, err := ctrd.Client().ImageStatus(t.Context(), p.Ref); err != nil {
		t.Fatalf("image not in containerd: %v", err)
	}
}
