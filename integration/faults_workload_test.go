package integration_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/puller"
)

// The client side of the fault test: what a kubelet-like user does while parts die. Every operation is
// retried until it is acknowledged (a publish acked by JetStream, a CRI call that returned), as a user
// would, and every acknowledged operation goes into the ledger that the checks compare the system's end
// state with.

// faultPodEvent is a pod event JetStream acknowledged, with its stream sequence.
type faultPodEvent struct {
	id     string
	action string
	msg    bus.RawMsg
	seq    uint64
}

// faultRealPod is a pod with a real container: in the pod index from appliedAt (the index confirmed it)
// until deletedAt (its pod.deleted was about to be published), its container running from containerAt
// until goneAt (its sandbox was about to be stopped). Zero times: not reached.
type faultRealPod struct {
	n                            int
	pod                          *v1.Pod
	image, imageID               string
	sandboxID                    string
	appliedAt, containerAt       time.Time
	goneAt, deletedAt            time.Time
	gaveUp                       string // why the pod never got a container
	pullAttempts, createAttempts int
}

// faultPullResult is the terminal event of a pull request, as the watcher saw it.
type faultPullResult struct {
	action string
	r      events.PullResult
}

type faultWorkload struct {
	node    string
	b       *bus.Bus
	cl      *cri.Client
	apps    []lab.Pushed
	missing string
	seed    uint64
	// ctx is the test's: an operation in progress when stop closes still finishes (with its retries).
	ctx  context.Context
	stop chan struct{}
	wg   sync.WaitGroup

	watchCancel context.CancelFunc
	watchDone   chan struct{}

	mu        sync.Mutex
	podEvents []faultPodEvent
	pulls     map[string]string // request id -> image, for every request JetStream acked
	realPods  []*faultRealPod
	results   map[string]faultPullResult
	errs      []string
	retries   map[string]int // client retries by operation, while a part was down
	gcAsked   int
	gcOK      int
	nextID    int
}

func newFaultWorkload(ctx context.Context, node string, b *bus.Bus, cl *cri.Client, apps []lab.Pushed, missing string, seed uint64) *faultWorkload {
	return &faultWorkload{node: node, b: b, cl: cl, apps: apps, missing: missing, seed: seed, ctx: ctx,
		stop: make(chan struct{}), pulls: map[string]string{}, results: map[string]faultPullResult{}, retries: map[string]int{}}
}

// start runs the watcher and the four kinds of client: pod churn in the index, pods with real containers,
// pulls, and GC passes.
func (w *faultWorkload) start() {
	wctx, cancel := context.WithCancel(w.ctx)
	w.watchCancel, w.watchDone = cancel, make(chan struct{})
	go func() { defer close(w.watchDone); w.watchResults(wctx) }()
	for i, f := range []func(*rand.Rand){w.churnIndexPods, w.runRealPods, w.runPulls, w.runGC} {
		w.wg.Add(1)
		rng := rand.New(rand.NewPCG(w.seed, uint64(i+2)))
		go func() { defer w.wg.Done(); f(rng) }()
	}
}

// stopClients stops the clients once their current operation is through; the watcher keeps running.
func (w *faultWorkload) stopClients() {
	close(w.stop)
	w.wg.Wait()
}

func (w *faultWorkload) stopWatcher() {
	w.watchCancel()
	<-w.watchDone
}

func (w *faultWorkload) stopped() bool {
	select {
	case <-w.stop:
		return true
	default:
		return false
	}
}

// pause sleeps d unless the clients are stopped.
func (w *faultWorkload) pause(d time.Duration) {
	select {
	case <-w.stop:
	case <-time.After(d):
	}
}

func (w *faultWorkload) fail(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.errs = append(w.errs, fmt.Sprintf(format, args...))
}

func (w *faultWorkload) retried(op string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.retries[op]++
}

func (w *faultWorkload) id(prefix string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.nextID++
	return fmt.Sprintf("%s-%d", prefix, w.nextID)
}

// retry calls op until it succeeds, the test ends, or limit passes (then the failure is recorded: an
// operation a user retried for that long never went through).
func (w *faultWorkload) retry(what string, limit time.Duration, op func(ctx context.Context) error) error {
	deadline := time.Now().Add(limit)
	for {
		ctx, cancel := context.WithTimeout(w.ctx, 5*time.Second)
		err := op(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if w.ctx.Err() != nil {
			return err
		}
		if time.Now().After(deadline) {
			w.fail("%s: not through after %s of retries: %v", what, limit, err)
			return err
		}
		w.retried(what)
		time.Sleep(150 * time.Millisecond) // the client's retry interval
	}
}

// publishPod publishes one pod event with a fixed id (a retried publish is stored once) until JetStream
// acknowledges it, and records it with its stream sequence.
func (w *faultWorkload) publishPod(action string, pod *v1.Pod) (uint64, error) {
	id := w.id("podev")
	m, err := podindex.PodEventMsg(w.node, action, pod, id, time.Now())
	if err != nil {
		return 0, err
	}
	var seq uint64
	err = w.retry("publish pod event", 3*time.Minute, func(ctx context.Context) error {
		s, err := w.b.PublishMsgs(ctx, []bus.RawMsg{m})
		seq = s
		return err
	})
	if err != nil {
		return 0, err
	}
	w.mu.Lock()
	w.podEvents = append(w.podEvents, faultPodEvent{id: id, action: action, msg: m, seq: seq})
	w.mu.Unlock()
	return seq, nil
}

// waitApplied waits until the pod index applied seq, as `imagefleet pods apply --wait` does.
func (w *faultWorkload) waitApplied(seq uint64, limit time.Duration) error {
	return w.retry("wait for the pod index", limit, func(ctx context.Context) error {
		var rep events.RefsReply
		if err := w.b.Request(ctx, events.QuerySubject(w.node, events.QryRefs), nil, &rep); err != nil {
			return err
		}
		if rep.AppliedSeq < seq {
			return fmt.Errorf("applied %d of %d", rep.AppliedSeq, seq)
		}
		return nil
	})
}

// publishPull queues a pull request until JetStream acknowledges it (a full queue is retried too).
func (w *faultWorkload) publishPull(req events.PullRequest) error {
	err := w.retry("queue pull request", 3*time.Minute, func(ctx context.Context) error {
		_, err := puller.Enqueue(ctx, w.b, w.node, req)
		return err
	})
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.pulls[req.ID] = req.Image
	w.mu.Unlock()
	return nil
}

// result waits up to limit for the terminal result of a pull request.
func (w *faultWorkload) result(id string, limit time.Duration) (faultPullResult, bool) {
	deadline := time.Now().Add(limit)
	for {
		w.mu.Lock()
		r, ok := w.results[id]
		w.mu.Unlock()
		if ok || time.Now().After(deadline) || w.ctx.Err() != nil {
			return r, ok
		}
		time.Sleep(50 * time.Millisecond) // polling interval, not an assertion
	}
}

// watchResults follows the node's pull events in the stream, resuming after its last sequence when the
// connection drops.
func (w *faultWorkload) watchResults(ctx context.Context) {
	var last uint64
	filter := events.EventSubject(w.node, events.EntityPull, "*")
	for ctx.Err() == nil {
		_ = w.b.Read(ctx, events.EventsStream, filter, func(m bus.StreamMsg) error {
			last = m.Seq
			ev, err := events.DecodeEvent(m.Data)
			if err != nil {
				return nil
			}
			if ev.Type == events.TypeName(events.EntityPull, events.ActionPulling) {
				return nil
			}
			var r events.PullResult
			if ev.DecodeData(&r) != nil {
				return nil
			}
			action := events.ActionPulled
			if ev.Type == events.TypeName(events.EntityPull, events.ActionFailed) {
				action = events.ActionFailed
			}
			w.mu.Lock()
			if _, ok := w.results[r.RequestID]; !ok {
				w.results[r.RequestID] = faultPullResult{action: action, r: r}
			}
			w.mu.Unlock()
			return nil
		}, bus.Follow(), bus.From(last+1))
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// churnIndexPods adds, updates and deletes pods that only live in the index, with changing secret and
// configmap references and phases: the pod index's part of the ledger.
func (w *faultWorkload) churnIndexPods(rng *rand.Rand) {
	type slot struct {
		pod *v1.Pod
		gen int
	}
	slots := make([]slot, 24)
	for !w.stopped() {
		k := rng.IntN(len(slots))
		s := &slots[k]
		var action string
		switch {
		case s.pod == nil:
			s.gen++
			s.pod = &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: fmt.Sprintf("ns-%d", k%3), Name: fmt.Sprintf("idx-%d", k),
				UID: types.UID(fmt.Sprintf("idx-%d-%d", k, s.gen))}}
			action = events.ActionAdded
		case rng.IntN(5) == 0:
			action = events.ActionDeleted
		default:
			s.pod = s.pod.DeepCopy()
			action = events.ActionUpdated
		}
		if action != events.ActionDeleted {
			faultMutatePod(rng, s.pod)
		}
		if _, err := w.publishPod(action, s.pod); err != nil {
			return
		}
		if action == events.ActionDeleted {
			s.pod = nil
		}
		w.pause(time.Duration(20+rng.IntN(120)) * time.Millisecond)
	}
}

// faultMutatePod gives an index-only pod new references, image and phase, and bumps its revision.
func faultMutatePod(rng *rand.Rand, p *v1.Pod) {
	rev, _ := strconv.Atoi(p.Annotations["fault/rev"])
	p.Annotations = map[string]string{"fault/rev": strconv.Itoa(rev + 1)}
	c := v1.Container{Name: "c", Image: fmt.Sprintf("example.invalid/idx-img-%d:1", rng.IntN(8))}
	for range rng.IntN(3) {
		c.EnvFrom = append(c.EnvFrom, v1.EnvFromSource{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("s-%d", rng.IntN(8))}}})
	}
	for range rng.IntN(3) {
		c.Env = append(c.Env, v1.EnvVar{Name: "x", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cm-%d", rng.IntN(5))}}}})
	}
	p.Spec = v1.PodSpec{Containers: []v1.Container{c}}
	if rng.IntN(3) == 0 {
		p.Spec.ImagePullSecrets = []v1.LocalObjectReference{{Name: fmt.Sprintf("pull-%d", rng.IntN(3))}}
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

// runRealPods keeps up to three pods with real containers coming and going, in the kubelet's order: the pod
// is in the index (so GC keeps its image), then its image is pulled, then its container runs; on the way
// out the container goes first, then the pod.
func (w *faultWorkload) runRealPods(rng *rand.Rand) {
	var live []*faultRealPod
	n := 0
	for !w.stopped() {
		if len(live) < 3 && (len(live) == 0 || rng.IntN(2) == 0) {
			n++
			if p := w.startRealPod(rng, n); p != nil && p.gaveUp == "" {
				live = append(live, p)
			}
		} else if len(live) > 0 {
			i := rng.IntN(len(live))
			w.stopRealPod(live[i])
			live = append(live[:i], live[i+1:]...)
		}
		w.pause(time.Duration(200+rng.IntN(800)) * time.Millisecond)
	}
}

func (w *faultWorkload) startRealPod(rng *rand.Rand, n int) *faultRealPod {
	app := w.apps[rng.IntN(len(w.apps))]
	p := &faultRealPod{n: n, image: app.Ref, imageID: app.ID}
	p.pod = &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "fault-real", Name: fmt.Sprintf("real-%d", n), UID: types.UID(fmt.Sprintf("real-uid-%d", n))},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: app.Ref,
			EnvFrom: []v1.EnvFromSource{{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("s-%d", n%8)}}}}}}},
		Status: v1.PodStatus{Phase: v1.PodRunning},
	}
	w.mu.Lock()
	w.realPods = append(w.realPods, p)
	w.mu.Unlock()
	seq, err := w.publishPod(events.ActionAdded, p.pod)
	if err != nil {
		p.gaveUp = "pod event not published"
		return p
	}
	if err := w.waitApplied(seq, 3*time.Minute); err != nil {
		p.gaveUp = "pod index never applied the pod"
		return p
	}
	p.appliedAt = time.Now()
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) && w.ctx.Err() == nil {
		if !w.pullForPod(p) {
			p.gaveUp = "no successful pull"
			return p
		}
		switch err := w.runContainer(p); {
		case err == nil:
			return p
		case errors.Is(err, errImageGone):
			continue // removed between the pull and the container: pull again
		default:
			p.gaveUp = err.Error()
			return p
		}
	}
	p.gaveUp = "no container within 3m"
	return p
}

var errImageGone = errors.New("image not present")

// pullForPod queues pulls for the pod's image until one succeeds (failures while containerd is down, and
// the backoff after them, are results too).
func (w *faultWorkload) pullForPod(p *faultRealPod) bool {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) && w.ctx.Err() == nil {
		p.pullAttempts++
		req := events.PullRequest{ID: fmt.Sprintf("real-%d-%d", p.n, p.pullAttempts), Image: p.image, Policy: events.PullIfNotPresent,
			Pod: &events.PodRef{Namespace: p.pod.Namespace, Name: p.pod.Name, UID: string(p.pod.UID)}, Enqueued: time.Now().UTC()}
		if err := w.publishPull(req); err != nil {
			return false
		}
		r, ok := w.result(req.ID, 90*time.Second)
		if ok && r.r.Error == "" {
			return true
		}
		time.Sleep(time.Second) // before asking again, as the kubelet's sync loop would
	}
	return false
}

// runContainer starts a sandbox and a container from the pod's image, each attempt under a new sandbox
// name (an attempt cut by a containerd kill may have left its sandbox behind).
func (w *faultWorkload) runContainer(p *faultRealPod) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) && w.ctx.Err() == nil {
		p.createAttempts++
		sb := lab.PodSandboxConfig(fmt.Sprintf("real-%d-%d", p.n, p.createAttempts))
		err := func() error {
			ctx, cancel := context.WithTimeout(w.ctx, 20*time.Second)
			defer cancel()
			sbID, err := w.cl.RunPodSandbox(ctx, sb)
			if err != nil {
				return err
			}
			cID, err := w.cl.CreateContainer(ctx, sbID, sb, "c", p.image, nil)
			if err == nil {
				err = w.cl.StartContainer(ctx, cID)
			}
			if err != nil {
				_ = w.cl.StopPodSandbox(ctx, sbID)
				_ = w.cl.RemovePodSandbox(ctx, sbID)
				if _, sErr := w.cl.ImageStatus(ctx, p.image); errors.Is(sErr, cri.ErrNotFound) {
					return errImageGone
				}
				return err
			}
			p.sandboxID = sbID
			return nil
		}()
		if err == nil {
			p.containerAt = time.Now()
			return nil
		}
		if errors.Is(err, errImageGone) {
			return err
		}
		w.retried("run container")
		time.Sleep(300 * time.Millisecond)
	}
	return fmt.Errorf("no container for pod %d within 2m", p.n)
}

// stopRealPod removes the pod's sandbox, then publishes its deletion.
func (w *faultWorkload) stopRealPod(p *faultRealPod) {
	p.goneAt = time.Now()
	err := w.retry("remove sandbox", 3*time.Minute, func(ctx context.Context) error {
		if err := w.cl.StopPodSandbox(ctx, p.sandboxID); err != nil && !errors.Is(err, cri.ErrNotFound) {
			return err
		}
		if err := w.cl.RemovePodSandbox(ctx, p.sandboxID); err != nil && !errors.Is(err, cri.ErrNotFound) {
			return err
		}
		return nil
	})
	if err != nil {
		return
	}
	deletedAt := time.Now()
	if _, err := w.publishPod(events.ActionDeleted, p.pod); err == nil {
		w.mu.Lock()
		p.deletedAt = deletedAt
		w.mu.Unlock()
	}
}

// runPulls queues pulls of the lab's images (and of one the registry does not have) with both policies,
// one after another, waiting a while for each result.
func (w *faultWorkload) runPulls(rng *rand.Rand) {
	for !w.stopped() {
		req := events.PullRequest{ID: w.id("bg-pull"), Policy: events.PullIfNotPresent, Enqueued: time.Now().UTC()}
		switch r := rng.IntN(10); {
		case r == 0:
			req.Image = w.missing
		case r < 4:
			req.Image, req.Policy = w.apps[rng.IntN(len(w.apps))].Ref, events.PullAlways
		default:
			req.Image = w.apps[rng.IntN(len(w.apps))].Ref
		}
		if w.publishPull(req) != nil {
			return
		}
		w.result(req.ID, 15*time.Second)
		w.pause(time.Duration(100+rng.IntN(400)) * time.Millisecond)
	}
}

// runGC asks for DeleteUnusedImages passes (the agent also runs its own periodic passes with a short
// maximum age).
func (w *faultWorkload) runGC(rng *rand.Rand) {
	for !w.stopped() {
		w.pause(time.Duration(800+rng.IntN(1700)) * time.Millisecond)
		ctx, cancel := context.WithTimeout(w.ctx, 30*time.Second)
		var res events.GCResult
		err := w.b.Request(ctx, events.CommandSubject(w.node, events.VerbGC), events.GCRequest{AllUnused: true}, &res)
		cancel()
		w.mu.Lock()
		w.gcAsked++
		if err == nil && res.Error == "" {
			w.gcOK++
		}
		w.mu.Unlock()
	}
}
