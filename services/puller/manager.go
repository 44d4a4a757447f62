package puller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// imageService is the kubelet's view of the runtime's images (kubecontainer.ImageService), by the names the
// kubelet's tests record: GetImageRef and GetImageSize are CRI ImageStatus, PullImage is CRI PullImage.
type imageService interface {
	// GetImageRef returns the image ID of image, "" when the runtime does not have it.
	GetImageRef(ctx context.Context, image string) (string, error)
	PullImage(ctx context.Context, image string, auth *cri.AuthConfig, sandbox *cri.SandboxConfig, annotations map[string]string) (string, error)
	GetImageSize(ctx context.Context, image string) (uint64, error)
}

// credentialSource finds the credentials of a pull: the pod's pull secrets first, then the node keyring.
type credentialSource interface {
	Lookup(ctx context.Context, repo string, req Request) ([]Credential, error)
}

// KubeEvent is a Kubernetes event the kubelet would post on the pod for this request.
type KubeEvent struct {
	Severity string // Normal or Warning
	Reason   string
	Message  string
}

// Request is one EnsureImageExists call.
type Request struct {
	// Image is the image as the pod spec writes it (requestedImage).
	Image string
	// Policy is Always, IfNotPresent or Never ("" applies Kubernetes' defaulting).
	Policy string
	// Pod is the pod pulling (zero for a pre-pull).
	Pod            events.PodRef
	Secrets        []string
	Annotations    map[string]string
	RuntimeHandler string
	// OnEvent, when set, receives each event as it happens (Pulling before the pull, so a watcher sees
	// progress); Outcome.Events has them all afterwards.
	OnEvent func(KubeEvent)
	// AllowPrivate: a request without a pod may use the node keyring's credentials (events.PullRequest).
	AllowPrivate bool

	// anchor, when set, holds the work-queue message the request came with (or rides on) while a runtime
	// pull the request starts runs (the Service's riders, riders.go).
	anchor *anchor
	// joined, when set, is called when the request joins a runtime pull another request started whose
	// flight has an anchor, before the request waits for it, with that anchor held once more: the callee
	// releases it. The Service gives the request's own token back there.
	joined func(*anchor)
}

// Outcome is what EnsureImageExists returns: the kubelet's (imageRef, message, err) plus what it observed.
type Outcome struct {
	ImageRef string
	// Message is the kubelet's message (the container waiting message on failure).
	Message string
	// Err is nil or wraps one of the error kinds (ErrImagePull, ErrImagePullBackOff, ...).
	Err    error
	Events []KubeEvent
	// Pulled: a runtime pull succeeded for this request; Shared: it joined another request's pull.
	Pulled, Shared, Cancelled bool
	ImageSize                 uint64
	PullDuration, Total       time.Duration
}

// Kind is the error kind name ("" on success).
func (o Outcome) Kind() string { return kindOf(o.Err) }

// managerConfig is what the manager needs of Config.
type managerConfig struct {
	// tokens is the most runtime pulls this process runs at once (0: unlimited).
	tokens                int
	qps                   float64
	burst                 int
	backoff               backoffPolicy
	verifyPolicy          string
	allowlist             []string
	now                   func() time.Time
	log                   *slog.Logger
	disableSingleFlight   bool
	secretPulledImagesOff bool
}

// manager is the kubelet's imageManager + puller for one node.
type manager struct {
	cfg managerConfig
	svc imageService
	// room makes room on the image filesystem before a runtime pull (nil: pull whatever the usage).
	room    *room
	creds   credentialSource
	backoff backoffStore
	records *pullManager
	metrics *metrics
	tokens  chan struct{}
	limiter *rate.Limiter

	mu      sync.Mutex
	flights map[string]*flight
	wg      sync.WaitGroup // flights running
}

type flight struct {
	done    chan struct{}
	res     pullResult
	waiters int
	cancel  context.CancelCauseFunc
	// anchor is the leader's (nil: none), held until the flight has ended.
	anchor *anchor
}

type pullResult struct {
	imageRef     string
	imageSize    uint64
	err          error
	pullDuration time.Duration
	credsUsed    *Credential
	shared       bool
}

func newManager(cfg managerConfig, svc imageService, creds credentialSource, bo backoffStore, rs recordStore, m *metrics) *manager {
	mg := &manager{cfg: cfg, svc: svc, creds: creds, backoff: bo, metrics: m, flights: map[string]*flight{},
		records: &pullManager{store: rs, policy: cfg.verifyPolicy, allowlist: cfg.allowlist, now: cfg.now, checks: m.mustPullChecks}}
	if cfg.tokens > 0 {
		mg.tokens = make(chan struct{}, cfg.tokens)
	}
	if cfg.qps > 0 {
		mg.limiter = rate.NewLimiter(rate.Limit(cfg.qps), cfg.burst)
	}
	return mg
}

// wait blocks until every pull the manager started has ended (their contexts end with their requests').
func (m *manager) wait() { m.wg.Wait() }

// EnsureImageExists is the kubelet's EnsureImageExists for req: same decisions, same events and messages,
// same error kinds, same backoff.
func (m *manager) EnsureImageExists(ctx context.Context, req Request) (out Outcome) {
	start := time.Now()
	emit := func(sev, reason, msg string) {
		ev := KubeEvent{Severity: sev, Reason: reason, Message: msg}
		out.Events = append(out.Events, ev)
		if req.OnEvent != nil {
			req.OnEvent(ev)
		}
	}
	fail := func(msg string, err error) Outcome {
		out.Message, out.Err = msg, err
		return out
	}
	policy := req.Policy
	if policy == "" {
		policy = defaultPullPolicy(req.Image)
	}
	var presentLocally, pullRequired *bool
	defer func() {
		m.metrics.recordEnsure(policy, presentLocally, pullRequired)
		out.Total = time.Since(start)
	}()

	image, err := applyDefaultImageTag(req.Image)
	if err != nil {
		msg := fmt.Sprintf("Failed to apply default image tag %q: %v", req.Image, err)
		emit(events.Warning, ReasonInspectFailed, msg)
		return fail(msg, ErrInvalidImageName)
	}

	// Pre-check by pull policy.
	var imageRef string
	if policy != events.PullAlways {
		imageRef, err = m.svc.GetImageRef(ctx, image)
		if err != nil {
			msg := fmt.Sprintf("Failed to inspect image %q: %v", imageRef, err)
			emit(events.Warning, ReasonInspectFailed, msg)
			return fail(msg, ErrImageInspect)
		}
		found := imageRef != ""
		presentLocally = &found
		if !found && policy == events.PullNever {
			return fail(m.neverPull(req.Image, emit))
		}
	}

	repo, _, _, _ := parseImageName(image)
	var (
		credsOnce sync.Once
		creds     []Credential
		credsErr  error
	)
	lookup := func() ([]Credential, error) {
		credsOnce.Do(func() {
			if m.creds != nil {
				creds, credsErr = m.creds.Lookup(ctx, repo, req)
			}
		})
		return creds, credsErr
	}

	if imageRef != "" {
		f := false
		pullRequired = &f
		must := false
		if !m.cfg.secretPulledImagesOff {
			must = m.records.mustAttemptImagePull(ctx, req.Image, imageRef, func() (podCredentials, error) {
				cs, err := lookup()
				if err != nil {
					return podCredentials{}, err
				}
				return podCredentialsOf(cs), nil
			})
		}
		if !must {
			msg := fmt.Sprintf("Container image %q already present on machine and can be accessed by the pod", req.Image)
			if m.cfg.secretPulledImagesOff {
				msg = fmt.Sprintf("Container image %q already present on machine", req.Image)
			}
			emit(events.Normal, ReasonPulled, msg)
			out.ImageRef, out.Message = imageRef, msg
			return out
		}
	}
	t := true
	pullRequired = &t

	if policy == events.PullNever {
		return fail(m.neverPull(req.Image, emit))
	}
	cs, err := lookup()
	if err != nil {
		return fail(err.Error(), fmt.Errorf("%w: %w", ErrImagePull, err))
	}
	if req.Pod.UID == "" && len(cs) > 0 && !req.AllowPrivate {
		// A pre-pull of a private image: pulled through CRI it has no kubelet pull record, and the kubelet's
		// default NeverVerifyPreloadedImages would let every pod on the node use it. Only on request.
		return fail(fmt.Sprintf("Pre-pull of %q refused: it needs the node's registry credentials, and an image pulled without the kubelet has no pull record, so any pod on the node could use it (KubeletEnsureSecretPulledImages, NeverVerifyPreloadedImages); ask with --allow-private to pull it anyway", req.Image),
			ErrImagePull)
	}
	return m.pullImage(ctx, req, image, cs, emit, &out)
}

func (m *manager) neverPull(image string, emit func(sev, reason, msg string)) (string, error) {
	msg := fmt.Sprintf("Container image %q is not present with pull policy of Never", image)
	emit(events.Warning, ReasonErrImageNeverPull, msg)
	return msg, ErrImageNeverPull
}

func podCredentialsOf(cs []Credential) podCredentials {
	var pc podCredentials
	for _, c := range cs {
		switch {
		case c.Secret != nil:
			pc.secrets = append(pc.secrets, RecordSecret{UID: c.Secret.UID, Namespace: c.Secret.Namespace,
				Name: c.Secret.Name, CredentialHash: c.Hash})
		case c.ServiceAccount != nil && pc.serviceAccount == nil:
			pc.serviceAccount = &RecordServiceAccount{UID: c.ServiceAccount.UID, Namespace: c.ServiceAccount.Namespace,
				Name: c.ServiceAccount.Name}
		}
	}
	return pc
}

// errCancelled marks a pull cancelled on purpose (pod deleted, explicit cancellation): no backoff.
var errCancelled = errors.New("pull cancelled")

func (m *manager) pullImage(ctx context.Context, req Request, image string, creds []Credential, emit func(sev, reason, msg string), out *Outcome) Outcome {
	requested := req.Image
	log := m.cfg.log.With("image_ref", requested, "pod_uid", req.Pod.UID)
	if !m.cfg.secretPulledImagesOff {
		if err := m.records.store.AddIntent(ctx, requested); err != nil {
			out.Message = fmt.Sprintf("Failed to record image pull intent for container image %q: %v", requested, err)
			out.Err = fmt.Errorf("%w: %w", ErrImagePull, err)
			return *out
		}
	}
	succeeded := false
	var used *Credential
	defer func() {
		if m.cfg.secretPulledImagesOff {
			return
		}
		// The record outlives the request: write it even when the request's context has just ended.
		rctx := context.WithoutCancel(ctx)
		if succeeded {
			if err := m.records.recordImagePulled(rctx, requested, out.ImageRef, used); err != nil {
				log.Warn("record image pulled failed", "err", err)
			}
		} else if err := m.records.store.DoneIntent(rctx, requested); err != nil {
			log.Warn("record image pull failed failed", "err", err)
		}
	}()

	key := req.Pod.UID + "_" + requested
	now := m.cfg.now()
	entry, ok, err := m.backoff.Get(ctx, key)
	if err != nil {
		// Fail open like a kubelet that just restarted: no backoff state.
		log.Warn("read backoff failed", "err", err)
		ok = false
	}
	if m.cfg.backoff.inBackoff(entry, ok, now) {
		msg := fmt.Sprintf("Back-off pulling image %q", requested)
		emit(events.Normal, ReasonBackOff, msg)
		if entry.LastError != "" {
			msg = fmt.Sprintf("%s: %s", msg, entry.LastError)
		}
		out.Message, out.Err = msg, ErrImagePullBackOff
		return *out
	}
	if ok && entry.LastError != "" {
		entry.LastError = ""
		if err := m.backoff.Put(ctx, entry); err != nil {
			log.Warn("write backoff failed", "err", err)
		}
	}

	emit(events.Normal, ReasonPulling, fmt.Sprintf("Pulling image %q", requested))
	start := time.Now()
	res := m.pull(ctx, image, req, creds)
	out.Shared = res.shared
	if res.err != nil {
		if errors.Is(res.err, errCancelled) || ctx.Err() != nil {
			cause := res.err
			if c := context.Cause(ctx); c != nil {
				cause = c
			}
			out.Cancelled = true
			emit(events.Warning, ReasonFailed, fmt.Sprintf("Failed to pull image %q: %v", requested, cause))
			out.Message = fmt.Sprintf("pull of %q cancelled: %v", requested, cause)
			out.Err = fmt.Errorf("%w: %w", ErrImagePull, cause)
			return *out
		}
		emit(events.Warning, ReasonFailed, fmt.Sprintf("Failed to pull image %q: %v", requested, res.err))
		next := m.cfg.backoff.next(entry, ok, m.cfg.now())
		msg, kind := evalCRIPullErr(requested, res.err)
		next.Key, next.LastError = key, fmt.Sprintf("%s: %s", kind, msg)
		if err := m.backoff.Put(context.WithoutCancel(ctx), next); err != nil {
			log.Warn("write backoff failed", "err", err)
		}
		out.Message, out.Err = msg, kind
		return *out
	}
	total := time.Since(start).Truncate(time.Millisecond)
	emit(events.Normal, ReasonPulled, fmt.Sprintf("Successfully pulled image %q in %v (%v including waiting). Image size: %v bytes.",
		requested, res.pullDuration.Truncate(time.Millisecond), total, res.imageSize))
	m.metrics.pullDuration.WithLabelValues(sizeBucket(res.imageSize)).Observe(total.Seconds())
	m.backoff.GC(ctx, m.cfg.now(), m.cfg.backoff)
	succeeded, used = true, res.credsUsed
	out.ImageRef, out.ImageSize, out.PullDuration, out.Pulled = res.imageRef, res.imageSize, res.pullDuration, true
	return *out
}

// flightKey makes concurrent requests share a pull only when they would make the same runtime call: same
// image, runtime handler and credentials (a pod must not get an image through another pod's secret).
func flightKey(image string, req Request, creds []Credential) string {
	var b strings.Builder
	b.WriteString(image)
	b.WriteString("\x00")
	b.WriteString(req.RuntimeHandler)
	for _, c := range creds {
		b.WriteString("\x00")
		b.WriteString(c.Hash)
	}
	return b.String()
}

// pull runs or joins the pull of image with creds. The runtime pull runs under its own context, cancelled
// when every request waiting on it has gone (a pod deleted, kubernetes/kubernetes#88662).
func (m *manager) pull(ctx context.Context, image string, req Request, creds []Credential) pullResult {
	key := flightKey(image, req, creds)
	var held *anchor // the leader's anchor, held for this request
	m.mu.Lock()
	f, joined := m.flights[key]
	if joined && !m.cfg.disableSingleFlight {
		f.waiters++
		m.metrics.shared.Inc()
		// Held under mu, while the flight is still in flights and so holds its anchor: the anchor cannot
		// have gone idle (its message acked) before this request is counted on it.
		if f.anchor != nil && req.joined != nil {
			f.anchor.hold()
			held = f.anchor
		}
	} else {
		fctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
		f = &flight{done: make(chan struct{}), waiters: 1, cancel: cancel, anchor: req.anchor}
		if f.anchor != nil {
			f.anchor.hold()
		}
		joined = false
		if !m.cfg.disableSingleFlight {
			m.flights[key] = f
		}
		m.wg.Add(1)
		go m.runFlight(fctx, key, f, image, req, creds)
	}
	m.mu.Unlock()
	if held != nil {
		req.joined(held)
	}

	select {
	case <-f.done:
		res := f.res
		res.shared = joined
		return res
	case <-ctx.Done():
		cause := context.Cause(ctx)
		m.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			f.cancel(cause)
			if m.flights[key] == f {
				delete(m.flights, key)
			}
		}
		m.mu.Unlock()
		return pullResult{err: fmt.Errorf("%w: %w", errCancelled, cause), shared: joined}
	}
}

func (m *manager) runFlight(ctx context.Context, key string, f *flight, image string, req Request, creds []Credential) {
	defer m.wg.Done()
	defer f.cancel(nil)
	res := m.runtimePull(ctx, image, req, creds)
	m.mu.Lock()
	if m.flights[key] == f {
		delete(m.flights, key)
	}
	f.res = res
	m.mu.Unlock()
	close(f.done)
	// After the flight left flights: no request can join it any more, so none is counted on the anchor
	// once it may go idle.
	if f.anchor != nil {
		f.anchor.release()
	}
}

// runtimePull is the kubelet's puller: take a token (serial: the only one), pass the registry QPS limit,
// pull with each credential in turn, then ask the size (best effort).
func (m *manager) runtimePull(ctx context.Context, image string, req Request, creds []Credential) pullResult {
	if m.tokens != nil {
		select {
		case m.tokens <- struct{}{}:
			defer func() { <-m.tokens }()
		case <-ctx.Done():
			return pullResult{err: context.Cause(ctx)}
		}
	}
	start := time.Now()
	if m.limiter != nil && !m.limiter.AllowN(m.cfg.now(), 1) {
		return pullResult{err: errQPSExceeded, pullDuration: time.Since(start)}
	}
	if m.room != nil {
		var auth *cri.AuthConfig
		if len(creds) > 0 {
			a := creds[0].Auth
			auth = &a
		}
		if err := m.room.make(ctx, image, auth); err != nil {
			return pullResult{err: err, pullDuration: time.Since(start)}
		}
	}
	var sandbox *cri.SandboxConfig
	if req.Pod.UID != "" {
		sandbox = &cri.SandboxConfig{Name: req.Pod.Name, Namespace: req.Pod.Namespace, UID: req.Pod.UID, Annotations: req.Annotations}
	}
	var (
		ref  string
		err  error
		used *Credential
	)
	if len(creds) == 0 {
		ref, err = m.svc.PullImage(ctx, image, nil, sandbox, req.Annotations)
	} else {
		var errs []string
		for i := range creds {
			auth := creds[i].Auth
			ref, err = m.svc.PullImage(ctx, image, &auth, sandbox, req.Annotations)
			if err == nil {
				used = &creds[i]
				break
			}
			if ctx.Err() != nil {
				break
			}
			errs = append(errs, err.Error())
		}
		if err != nil && ctx.Err() == nil {
			err = aggregate(errs)
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w: %w", errCancelled, context.Cause(ctx))
		}
		return pullResult{err: err, pullDuration: time.Since(start)}
	}
	var size uint64
	if ref != "" {
		size, _ = m.svc.GetImageSize(ctx, image)
	}
	return pullResult{imageRef: ref, imageSize: size, pullDuration: time.Since(start), credsUsed: used}
}

// aggregate formats several errors as k8s.io/apimachinery's utilerrors aggregate: one message alone,
// several unique ones as "[a, b]".
func aggregate(msgs []string) error {
	seen := map[string]bool{}
	var uniq []string
	for _, s := range msgs {
		if !seen[s] {
			seen[s] = true
			uniq = append(uniq, s)
		}
	}
	if len(uniq) == 1 {
		return errors.New(uniq[0])
	}
	return errors.New("[" + strings.Join(uniq, ", ") + "]")
}
