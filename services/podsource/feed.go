package podsource

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// publisher stores pod events (bus.Bus).
type publisher interface {
	PublishMsgs(ctx context.Context, msgs []bus.RawMsg) (uint64, error)
}

// requester asks the pod index which pods it holds (bus.Bus).
type requester interface {
	Request(ctx context.Context, subject string, req, resp any) error
}

// streamer tells a stream's bounds (bus.Bus): whether an event the source waits for is still there.
type streamer interface {
	Stream(ctx context.Context, name string) (bus.StreamInfo, error)
}

// indexReader is what a source asks about the pod index: its pods, and the streams it reads (bus.Bus). The
// source's constructor hands it to both fields of the feed.
type indexReader interface {
	requester
	streamer
}

// publishBatch bounds the events of one PublishMsgs call during a resync.
const publishBatch = 512

// feed is what a source has published, by UID: the fingerprint of each pod (its JSON without config.seen)
// and its last JSON (the body of its pod.deleted). Its first content is the index's own listing of the
// source's pods, so an agent restart resumes where the index stands: a pod unchanged is not published
// again, a pod gone while the agent was down is deleted at the first sync.
type feed struct {
	node    string
	source  string   // "kubelet" or "apiserver": logs, metrics, health
	configs []string // the kubernetes.io/config.source values of this source's pods (listing filters)
	mirrors bool     // whether the source publishes mirror pods (the API server does; the Pods API has none)
	pub     publisher
	req     requester // nil: the source starts as if the index held none of its pods
	streams streamer  // nil with req
	log     *slog.Logger
	now     func() time.Time

	// lastSeq is the stream sequence of the last event the source published.
	lastSeq atomic.Uint64
	// indexGaps is the index's gap count at the last gapsGrew (noGaps before the first).
	indexGaps atomic.Uint64

	mu    sync.Mutex
	known map[types.UID]knownPod
	state health

	// ready is closed at the first sync (setUp): Ready.
	ready     chan struct{}
	readyOnce sync.Once
}

type knownPod struct {
	fp   [32]byte
	body []byte
}

func newFeed(node, source string, configs []string, mirrors bool, pub publisher, idx indexReader, log *slog.Logger) *feed {
	f := &feed{node: node, source: source, configs: configs, mirrors: mirrors, pub: pub,
		log: log.With("worker", "pod-source", "source", source), now: time.Now, known: map[types.UID]knownPod{},
		ready: make(chan struct{})}
	if idx != nil {
		f.req, f.streams = idx, idx
	}
	f.indexGaps.Store(noGaps)
	f.setDown(errors.New("not synced yet"))
	return f
}

// fingerprint is the SHA-256 of the pod's JSON without config.seen (the time the kubelet first saw it,
// which says nothing about the pod).
func fingerprint(p *v1.Pod) ([32]byte, []byte, error) {
	body, err := json.Marshal(p)
	if err != nil {
		return [32]byte{}, nil, err
	}
	if _, ok := p.Annotations[events.ConfigFirstSeenAnnotationKey]; !ok {
		return sha256.Sum256(body), body, nil
	}
	c := p.DeepCopy()
	delete(c.Annotations, events.ConfigFirstSeenAnnotationKey)
	b, err := json.Marshal(c)
	if err != nil {
		return [32]byte{}, nil, err
	}
	return sha256.Sum256(b), body, nil
}

// resume loads the index's pods of this source at start, waiting while the index says it is catching up
// and, for a minute, while no index answers (it usually starts with the source, in the same agent). Without
// an answer the source starts empty: it then publishes every pod once as added, and a pod deleted while it
// was down stays until the next reconcile that can read the index.
func (f *feed) resume(ctx context.Context) {
	if f.req == nil {
		return
	}
	known, err := f.readIndex(ctx, time.Now().Add(time.Minute))
	if err != nil {
		f.log.Warn("pod source starts without the index's pods", "err", err)
		return
	}
	f.mu.Lock()
	f.known = known
	f.mu.Unlock()
	f.log.Info("pod source resumed from the index", "pods", len(known))
}

// readIndex reads the index's listing of this source's pods, a page at a time, once the index has applied
// every event this source published (so the listing is not older than what the source knows). It waits
// while the index is catching up, and until noIndexBy while no index answers.
func (f *feed) readIndex(ctx context.Context, noIndexBy time.Time) (map[types.UID]knownPod, error) {
	known := map[types.UID]knownPod{}
	appliedBy := time.Now().Add(10 * time.Second)
	for _, src := range f.configs {
		q := events.PodsQuery{Source: src}
		for {
			var rep events.PodsReply
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := f.req.Request(rctx, events.QuerySubject(f.node, events.QryPods), q, &rep)
			cancel()
			if err == nil && q.After == "" && rep.AppliedSeq < f.lastSeq.Load() && !f.gone(ctx, f.lastSeq.Load()) {
				if time.Now().After(appliedBy) {
					return nil, fmt.Errorf("the index applied up to %d, not yet the source's last event %d", rep.AppliedSeq, f.lastSeq.Load())
				}
				err = errBehind
			}
			if err != nil {
				waiting := errors.Is(err, errBehind) || errors.Is(err, events.ErrIndexCatchingUp) || (errors.Is(err, bus.ErrNoResponders) && time.Now().Before(noIndexBy))
				if !waiting || ctx.Err() != nil {
					return nil, err
				}
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-time.After(100 * time.Millisecond):
				}
				continue
			}
			raws := rep.Pods
			if f.mirrors {
				raws = append(raws, rep.MirrorPods...)
			}
			for _, raw := range raws {
				var p v1.Pod
				if json.Unmarshal(raw, &p) != nil {
					continue
				}
				fp, body, err := fingerprint(&p)
				if err != nil {
					continue
				}
				known[p.UID] = knownPod{fp: fp, body: body}
			}
			if !rep.Truncated {
				break
			}
			q.After = rep.Next
		}
	}
	return known, nil
}

// gone reports whether the event at seq (an events stream sequence) may never reach the index, so that
// waiting for it is pointless: the pods stream the index reads has dropped it (its first sequence is past
// seq: a pods stream sequence is at most the events stream sequence of the same event, the pods stream
// holding a part of the events stream), or the events stream has (the server may not have copied it). A
// "gone" event the index applies after all is published once more by the reconcile, which changes nothing.
func (f *feed) gone(ctx context.Context, seq uint64) bool {
	if f.streams == nil {
		return false
	}
	for _, stream := range []string{events.PodsStream, events.EventsStream} {
		if info, err := f.streams.Stream(ctx, stream); err == nil && info.FirstSeq > seq {
			return true
		}
	}
	return false
}

// errBehind: the index has not applied the source's last event yet.
var errBehind = errors.New("index behind the source")

// change is one pod event to publish and the state it leaves.
type change struct {
	msg    bus.RawMsg
	uid    types.UID
	known  knownPod
	delete bool
	action string
}

// diff returns the change that brings the index from what it holds of pod to pod, or false when it holds it.
func (f *feed) diff(pod *v1.Pod) (change, bool, error) {
	fp, body, err := fingerprint(pod)
	if err != nil {
		return change{}, false, fmt.Errorf("encode pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	prev, had := f.known[pod.UID]
	if had && prev.fp == fp {
		return change{}, false, nil
	}
	action := events.UpsertAction(had) // the index holds the pod as far as the source knows when it had it
	return change{msg: bus.PodEventRaw(f.node, action, body, "", f.now()), uid: pod.UID,
		known: knownPod{fp: fp, body: body}, action: action}, true, nil
}

// upsert publishes pod as added or updated unless the index already holds it as it is.
func (f *feed) upsert(ctx context.Context, pod *v1.Pod) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, ok, err := f.diff(pod)
	if err != nil || !ok {
		return err
	}
	return f.publish(ctx, []change{c})
}

// remove publishes the deletion of the pod with uid (last seen as pod, when not nil) if the index holds it.
func (f *feed) remove(ctx context.Context, uid types.UID, pod *v1.Pod) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	prev, had := f.known[uid]
	if !had {
		return nil
	}
	body := prev.body
	if pod != nil {
		if _, b, err := fingerprint(pod); err == nil {
			body = b
		}
	}
	return f.publish(ctx, []change{{msg: bus.PodEventRaw(f.node, events.ActionDeleted, body, "", f.now()),
		uid: uid, delete: true, action: events.ActionDeleted}})
}

// replace makes the index hold exactly pods for this source: it publishes the added and changed pods and
// deletes those the source no longer has. With complete false (a pod of the source could not be decoded),
// it deletes nothing: a pod missing from the set may be the undecodable one.
//
// With fromIndex, it first reads what the index holds of the source's pods instead of trusting what the
// source published: events the index never applied (lost from the stream before it read them, or published
// by an earlier run that died) are then published again. Without an answer from the index it compares with
// what the source published.
//
// list gives the pods and whether the set is complete; it is called with the feed locked, so that a change
// handled after it waits for the replace, and one handled before it is in its set.
func (f *feed) replace(ctx context.Context, list func() ([]*v1.Pod, bool), fromIndex bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sourceResyncs.WithLabelValues(f.node, f.source).Inc()
	if fromIndex && f.req != nil {
		known, err := f.readIndex(ctx, time.Time{})
		if err != nil {
			f.log.Warn("pod source reconciles with what it published: the index did not answer", "err", err)
		} else {
			f.repairs(known)
			f.known = known
		}
	}
	pods, complete := list()
	var changes []change
	want := make(map[types.UID]bool, len(pods))
	for _, p := range pods {
		want[p.UID] = true
		c, ok, err := f.diff(p)
		if err != nil {
			return err
		}
		if ok {
			changes = append(changes, c)
		}
	}
	if complete {
		for uid, k := range f.known {
			if !want[uid] {
				changes = append(changes, change{msg: bus.PodEventRaw(f.node, events.ActionDeleted, k.body, "", f.now()),
					uid: uid, delete: true, action: events.ActionDeleted})
			}
		}
	}
	for len(changes) > 0 {
		n := min(len(changes), publishBatch)
		if err := f.publish(ctx, changes[:n]); err != nil {
			return err
		}
		changes = changes[n:]
	}
	return nil
}

// publish stores the changes' events and, once stored, records their state. Called with f.mu held.
func (f *feed) publish(ctx context.Context, cs []change) error {
	msgs := make([]bus.RawMsg, len(cs))
	for i, c := range cs {
		msgs[i] = c.msg
	}
	seq, err := f.pub.PublishMsgs(ctx, msgs)
	if err != nil {
		sourceErrors.WithLabelValues(f.node, f.source, "publish").Inc()
		return fmt.Errorf("publish pod events: %w", err)
	}
	if seq > f.lastSeq.Load() {
		f.lastSeq.Store(seq)
	}
	for _, c := range cs {
		if c.delete {
			delete(f.known, c.uid)
		} else {
			f.known[c.uid] = c.known
		}
		sourceEvents.WithLabelValues(f.node, f.source, c.action).Inc()
	}
	return nil
}

// health is a source's connection state, for /healthz and the up metric.
type health struct {
	up    bool
	err   error
	since time.Time
}

// Ready is closed once the source's first sync is done: the kubelet's initial pods (the Pods API's
// INITIAL_SYNC_COMPLETE) or the API server's first list compared with the index and the difference published,
// so the index holds the node's pods. While the kubelet's socket or the API server cannot be reached, the
// source retries and Ready stays open.
func (f *feed) Ready() <-chan struct{} { return f.ready }

func (f *feed) setUp() {
	f.readyOnce.Do(func() { close(f.ready) })
	f.mu.Lock()
	was := f.state.up
	f.state = health{up: true, since: f.now()}
	f.mu.Unlock()
	sourceUp.WithLabelValues(f.node, f.source).Set(1)
	if !was {
		f.log.Info("pod source synced")
	}
}

// setDown records that the source cannot reach its end; the index keeps its last state meanwhile.
func (f *feed) setDown(err error) {
	f.mu.Lock()
	was := f.state
	if was.up || was.err == nil {
		f.state = health{err: err, since: f.now()}
	} else {
		f.state.err = err
	}
	f.mu.Unlock()
	sourceUp.WithLabelValues(f.node, f.source).Set(0)
}

// Health is nil while the source is synced with its end, else why not (and since when).
func (f *feed) Health() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.state.up {
		return nil
	}
	return fmt.Errorf("pod source %s: not synced since %s: %w", f.source, f.state.since.UTC().Format(time.RFC3339), f.state.err)
}

// repairs logs and counts where the index differs from what the source published (events the index never
// applied); the replace that follows publishes them again. Called with f.mu held.
func (f *feed) repairs(index map[types.UID]knownPod) {
	missing, stale := 0, 0
	for uid, k := range f.known {
		if ik, ok := index[uid]; !ok {
			missing++
		} else if ik.fp != k.fp {
			stale++
		}
	}
	extra := 0
	for uid := range index {
		if _, ok := f.known[uid]; !ok {
			extra++
		}
	}
	if missing+stale+extra == 0 {
		return
	}
	sourceRepairs.WithLabelValues(f.node, f.source).Add(float64(missing + stale + extra))
	f.log.Error("pod index lost pod events of this source; publishing them again", "missing", missing, "stale", stale, "extra", extra)
}

// gapsGrew asks the pod index how many gaps it has seen (events dropped from the stream before it read
// them) and reports whether the count grew since the last call: the source then reconciles with the index.
func (f *feed) gapsGrew(ctx context.Context) bool {
	if f.req == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var rep events.PodsReply
	if err := f.req.Request(ctx, events.QuerySubject(f.node, events.QryPods), events.PodsQuery{Limit: 1}, &rep); err != nil {
		return false
	}
	// A count that changed (a restarted index counts from 0 again) and is not 0.
	prev := f.indexGaps.Swap(rep.Gaps)
	return prev != noGaps && rep.Gaps != prev && rep.Gaps > 0
}

// noGaps marks indexGaps as not read yet (the first reading is the baseline).
const noGaps = ^uint64(0)
