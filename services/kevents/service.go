package kevents

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
	"github.com/imagefleet/imagefleet/internal/redact"
)

// Service is the Events bridge of one node.
//
// How no Event is lost and none is posted twice. The bridge reads the node's events from a durable
// JetStream consumer and acks an event only after the API server accepted its Event (or the event is not
// one to post): an API-server outage holds the event, retried with backoff while the handler tells the
// server it is still at work, and the events behind it wait in the stream. client-go's correlator decides
// for each happening whether it is a new Event (create) or a repeat of a recent one (a patch of that
// Event's count, message and last timestamp), and its state lives in memory only; so the decided write,
// with its exact body, is stored in the DedupBucket under the imagefleet event's id before it is sent. An
// event delivered again (an agent restarted after the API answered but before the ack; the API's answer
// lost) finds its write there and sends it again unchanged: a create of the same name answers AlreadyExists
// (success), and a patch sets the same absolute count, message and time again. A create's name also
// derives from the event id, so even a write no longer in the bucket (older than DedupTTL) is not created
// twice. The bucket costs one small key-value write per posted Event; the alternative, names derived from
// the id alone, could not make the correlator's count patches idempotent.
type Service struct {
	cfg   Config
	kube  kubernetes.Interface
	bus   *bus.Bus
	dedup *bus.KV
	log   *slog.Logger
	m     *metrics

	// mu serializes correlation and writes: the correlator's counts follow the order of the stream.
	mu         sync.Mutex
	correlator *record.EventCorrelator
	pods       map[types.UID]bool // pods verified known to the API server (bounded, see podKnown)

	// ready is closed once the consumer of the node's events is at the server (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

// New validates cfg and builds the bridge. kube is the client of the API server (a node identity or the
// agent's ServiceAccount: events create and patch, pods list with a spec.nodeName field selector).
func New(ctx context.Context, cfg Config, kube kubernetes.Interface, b *bus.Bus) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if kube == nil {
		return nil, errors.New("kube events: no Kubernetes client")
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, kube: kube, bus: b, log: cfg.Logger.With("worker", "kube-events"), m: m,
		correlator: record.NewEventCorrelatorWithOptions(cfg.Correlator), pods: map[types.UID]bool{},
		ready: make(chan struct{})}
	if b != nil {
		if s.dedup, err = openDedup(ctx, b, cfg.DedupTTL); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// EnsureBucket creates the bridge's bucket with the default TTL: what `imagefleet bus init` runs with the
// admin identity, so agents with node identities, which may not create buckets, find it.
func EnsureBucket(ctx context.Context, b *bus.Bus) error {
	_, err := openDedup(ctx, b, 24*time.Hour)
	return err
}

func openDedup(ctx context.Context, b *bus.Bus, ttl time.Duration) (*bus.KV, error) {
	return b.KV(ctx, bus.KVConfig{Bucket: DedupBucket, Description: "Kubernetes Event writes decided per imagefleet event (kube-events bridge)",
		TTL: ttl})
}

// Ready is closed once the consumer of the node's events exists with its first pull request at the server:
// an event published after it is handled.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run consumes the node's events until ctx ends.
func (s *Service) Run(ctx context.Context) error {
	s.log.Info("kube events bridge started", "durable", s.cfg.Durable, "component", s.cfg.Component)
	err := s.bus.Consume(ctx, bus.ConsumerConfig{
		Stream: events.EventsStream, Durable: s.cfg.Durable,
		// One filter, the node's own events: a node identity may create exactly this (deploy/natsconf).
		FilterSubjects: []string{events.NodeEvents(s.cfg.Node)},
		// In stream order, one at a time: the correlator's counts are those of the happenings' order.
		Concurrency: 1, MaxAckPending: 256, AckWait: s.cfg.AckWait,
		// Failures are retried inside the handler (an outage must not exhaust deliveries); what reaches the
		// consumer's redelivery is a bucket failure or a stop.
		MaxDeliver: 1 << 30, Backoff: []time.Duration{time.Second, 5 * time.Second},
		Started: func() { s.readyOnce.Do(func() { close(s.ready) }) },
	}, func(ctx context.Context, m *bus.Msg) error {
		return s.Handle(ctx, m.Subject, m.Header, m.Data, m.InProgress)
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// Handle handles one message of the events stream: nil when it is done (posted, or not one to post), a
// bus.Permanent error when its Event can never be accepted, another error to have it delivered again.
// progress (may be nil) tells the stream the handler is still at work.
func (s *Service) Handle(ctx context.Context, subject string, header map[string][]string, data []byte, progress func() error) error {
	// Pod events carry a Pod, not an envelope; only node, pull and image events can carry a kubelet Event.
	if !postable(subject) {
		return nil
	}
	ev, err := events.DecodeEventMsg(header, data)
	if err != nil {
		s.m.result("malformed")
		s.log.Warn("event not decoded; not posted", "subject", subject, "err", err)
		return nil // not ours to dead-letter: other consumers read it too
	}
	ref, why := kubeRef(ev)
	if ref == nil {
		if why != whyNotKube {
			s.m.result("ignored")
			s.log.Info("event has no Kubernetes object to post it on; logged only", "event_id", ev.ID,
				"type", ev.Type, "reason", ev.Reason, "message", redact.Secrets(ev.Message), "why", why)
		}
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	key := dedupKey(ev)
	w, found, err := s.decided(ctx, key)
	if err != nil {
		return err
	}
	if !found {
		if ref.Kind == "Pod" && *s.cfg.VerifyPods {
			known, err := s.podKnown(ctx, ref, progress)
			if err != nil {
				return err
			}
			if !known {
				s.m.result("pod_unknown")
				s.log.Warn("pod not known to the API server; event not posted", "event_id", ev.ID,
					"pod", ref.Namespace+"/"+ref.Name, "pod_uid", string(ref.UID), "reason", ev.Reason)
				return nil
			}
		}
		w = s.decide(ev, ref)
		if err := s.store(ctx, key, w); err != nil {
			return err
		}
	} else {
		s.m.result("replayed")
	}
	if w.Skip {
		s.m.result("spam_filtered")
		return nil
	}
	return s.send(ctx, ev, w, progress)
}

// postable reports whether subject can carry a kubelet Event: imagefleet.evt.<node>.{node,pull,image}.<action>.
func postable(subject string) bool {
	rest, ok := strings.CutPrefix(subject, events.Prefix+".evt.")
	if !ok {
		return false
	}
	_, rest, ok = strings.Cut(rest, ".")
	if !ok {
		return false
	}
	entity, _, _ := strings.Cut(rest, ".")
	switch entity {
	case events.EntityNode, events.EntityPull, events.EntityImage:
		return true
	}
	return false
}

// write is the Kubernetes write decided for one imagefleet event.
type write struct {
	// Skip: client-go's spam filter dropped it (the kubelet's recorder drops it alike).
	Skip bool `json:"skip,omitempty"`
	// Event is the Event to create, or, with Patch, the Event whose name and namespace are patched.
	Event *v1.Event `json:"event,omitempty"`
	// Patch is the correlator's strategic merge patch (count, message, lastTimestamp) of a repeat.
	Patch json.RawMessage `json:"patch,omitempty"`
}

func (s *Service) decide(ev events.Event, ref *v1.ObjectReference) write {
	e := makeEvent(ev, ref, s.cfg.Component, s.cfg.Node)
	res, err := s.correlator.EventCorrelate(e)
	if err != nil {
		// A patch that could not be made: the correlator's event is still right; create it.
		s.log.Warn("event correlation failed; creating the event", "event_id", ev.ID, "err", err)
	}
	if res.Skip {
		return write{Skip: true}
	}
	w := write{Event: res.Event}
	if res.Event.Count > 1 && len(res.Patch) > 0 {
		w.Patch = res.Patch
	}
	return w
}

func (s *Service) decided(ctx context.Context, key string) (write, bool, error) {
	if s.dedup == nil {
		return write{}, false, nil
	}
	raw, _, err := s.dedup.Get(ctx, key)
	if errors.Is(err, bus.ErrKeyNotFound) {
		return write{}, false, nil
	}
	if err != nil {
		return write{}, false, fmt.Errorf("read decided event write: %w", err)
	}
	var w write
	if err := json.Unmarshal(raw, &w); err != nil || (!w.Skip && w.Event == nil) {
		// A value we cannot read is decided anew (at worst one Event counted twice, never lost).
		s.log.Warn("decided event write unreadable; deciding again", "key", key, "err", err)
		return write{}, false, nil
	}
	return w, true, nil
}

func (s *Service) store(ctx context.Context, key string, w write) error {
	if s.dedup == nil {
		return nil
	}
	raw, err := json.Marshal(w)
	if err != nil {
		return bus.Permanent(fmt.Errorf("encode event write: %w", err))
	}
	if _, err := s.dedup.Put(ctx, key, raw); err != nil {
		return fmt.Errorf("store decided event write: %w", err)
	}
	return nil
}

// send writes w until the API server accepts it, refuses it for good, or ctx ends.
func (s *Service) send(ctx context.Context, ev events.Event, w write, progress func() error) error {
	delay := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		out, result, err := s.writeOnce(ctx, w)
		if err == nil {
			s.correlator.UpdateState(out)
			s.m.result(result)
			return nil
		}
		switch classify(err) {
		case drop:
			s.m.result("refused")
			s.log.Warn("API server refused the event for good; not posted", "event_id", ev.ID, "reason", ev.Reason,
				"object", w.Event.InvolvedObject.Kind+" "+w.Event.InvolvedObject.Namespace+"/"+w.Event.InvolvedObject.Name, "err", err)
			return nil
		case deadLetter:
			s.m.result("refused")
			return bus.Permanent(fmt.Errorf("post event %s (%s) on %s %s/%s: %w", ev.ID, ev.Reason,
				w.Event.InvolvedObject.Kind, w.Event.InvolvedObject.Namespace, w.Event.InvolvedObject.Name, err))
		}
		s.m.apiErrors.Inc()
		if attempt == 1 || attempt%10 == 0 {
			s.log.Warn("API server did not take the event; holding it and retrying", "event_id", ev.ID,
				"reason", ev.Reason, "attempt", attempt, "err", err)
		}
		if progress != nil {
			_ = progress()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		if progress != nil {
			_ = progress()
		}
		delay = min(delay*2, s.cfg.RetryMax)
	}
}

// writeOnce is client-go's recordEvent: a patch of a repeat (a create when the Event is gone), else a create;
// a create that finds its name taken is the same Event, written before.
func (s *Service) writeOnce(ctx context.Context, w write) (*v1.Event, string, error) {
	e := w.Event.DeepCopy()
	evs := s.kube.CoreV1().Events(e.Namespace)
	if len(w.Patch) > 0 {
		out, err := evs.Patch(ctx, e.Name, types.StrategicMergePatchType, w.Patch, metav1.PatchOptions{})
		if err == nil {
			return out, "patched", nil
		}
		if !apierrors.IsNotFound(err) {
			return nil, "", err
		}
	}
	e.ResourceVersion = ""
	out, err := evs.Create(ctx, e, metav1.CreateOptions{})
	switch {
	case err == nil:
		return out, "created", nil
	case apierrors.IsAlreadyExists(err):
		return e, "already_posted", nil
	}
	return nil, "", err
}

type errClass int

const (
	retry      errClass = iota // outage, overload, credentials or RBAC being fixed: hold the event
	drop                       // the object's namespace is gone or going: nothing to post on
	deadLetter                 // the Event itself is invalid: it can never be posted
)

func classify(err error) errClass {
	var rce *restclient.RequestConstructionError
	if errors.As(err, &rce) {
		return deadLetter
	}
	switch {
	case apierrors.HasStatusCause(err, v1.NamespaceTerminatingCause), apierrors.IsNotFound(err):
		return drop
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err), apierrors.IsRequestEntityTooLargeError(err):
		return deadLetter
	}
	return retry
}

// podKnown reports whether the API server knows the pod ref is about: a pod of this node with its name and
// either its UID or, for a static pod, a mirror pod whose kubernetes.io/config.mirror is that UID. A list
// with spec.nodeName=<node> is what a node identity may do (the Node authorizer) and what the deploy's RBAC
// allows. A refused list cannot tell: the event is posted.
func (s *Service) podKnown(ctx context.Context, ref *v1.ObjectReference, progress func() error) (bool, error) {
	if ref.UID != "" && s.pods[ref.UID] {
		return true, nil
	}
	sel := fields.AndSelectors(fields.OneTermEqualSelector("spec.nodeName", s.cfg.Node),
		fields.OneTermEqualSelector("metadata.name", ref.Name)).String()
	delay := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		list, err := s.kube.CoreV1().Pods(ref.Namespace).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err == nil {
			for _, p := range list.Items {
				if ref.UID == "" || p.UID == ref.UID || p.Annotations[v1.MirrorPodAnnotationKey] == string(ref.UID) {
					if len(s.pods) >= 4096 {
						clear(s.pods)
					}
					if ref.UID != "" {
						s.pods[ref.UID] = true
					}
					return true, nil
				}
			}
			return false, nil
		}
		if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) && attempt > 3 {
			s.log.Warn("cannot verify the pod with the API server; posting its event", "pod", ref.Namespace+"/"+ref.Name, "err", err)
			return true, nil
		}
		s.m.apiErrors.Inc()
		if attempt == 1 || attempt%10 == 0 {
			s.log.Warn("API server did not answer a pod lookup; retrying", "pod", ref.Namespace+"/"+ref.Name, "attempt", attempt, "err", err)
		}
		if progress != nil {
			_ = progress()
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, s.cfg.RetryMax)
	}
}

type metrics struct {
	results   *prometheus.CounterVec
	apiErrors prometheus.Counter
}

func (m *metrics) result(r string) { m.results.WithLabelValues(r).Inc() }

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	results := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "imagefleet", Subsystem: "kube_events", Name: "total",
		Help: "imagefleet events handled by the Kubernetes Events bridge, by result: created, patched, already_posted, replayed, spam_filtered, pod_unknown, ignored, refused, malformed.",
	}, []string{"result"})
	apiErrors := prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "imagefleet", Subsystem: "kube_events", Name: "api_errors_total",
		Help: "Failed API-server calls of the Kubernetes Events bridge (each is retried).",
	})
	var m metrics
	var err error
	if m.results, err = promreg.RegisterOrReuse(reg, results); err != nil {
		return nil, err
	}
	if m.apiErrors, err = promreg.RegisterOrReuse(reg, apiErrors); err != nil {
		return nil, err
	}
	return &m, nil
}
