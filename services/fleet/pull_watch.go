package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// PullWatch runs a fleet pre-pull: it publishes one pull request per node to the node's work queue and
// waits for the result event the node's puller publishes (pull.pulled or pull.failed, matched by request
// id). One ordered consumer on every node's pull events serves the whole rollout; results are read from
// the replicated events stream, so a lost connection or a lost server loses none.
type PullWatch struct {
	b         *bus.Bus
	rolloutID string
	image     string
	policy    string
	// AllowPrivate lets the pre-pull use each node's registry credentials (events.PullRequest.AllowPrivate);
	// set it before Action runs.
	AllowPrivate bool

	// domains are the JetStream domains of the nodes whose pull queue is on a leaf (NodeInfo.JSDomain).
	domains map[string]string

	mu      sync.Mutex
	results map[string]events.PullResult
	waiters map[string]chan events.PullResult
	// The follower's state, for its watchdog (nudge): restart ends the current ordered consumer (the
	// follower makes a new one from next); progress is when it last read a message or (re)started.
	restart  context.CancelFunc
	next     uint64
	progress time.Time
	starts   int // ordered consumers made so far

	cancel context.CancelFunc
	done   chan struct{}
}

// followerStale is how long the follower may read nothing while a waiter's own lookup finds a result it
// has not reached, before it is made anew.
const followerStale = 2 * time.Second

// PullWatchOption tunes StartPullWatch.
type PullWatchOption func(*pullWatchOptions)

type pullWatchOptions struct {
	domains    map[string]string
	domainsSet bool
}

// WithNodeDomains gives the JetStream domains of the rollout's nodes (NodePlan.Domains: node -> domain, a
// node in the fleet's own domain left out), as the plan read them from the registry, so that StartPullWatch
// reads the registry no second time. Without it, StartPullWatch reads every node's domain from the registry
// (a rollout given its nodes by name has no plan).
func WithNodeDomains(domains map[string]string) PullWatchOption {
	return func(o *pullWatchOptions) { o.domains, o.domainsSet = domains, true }
}

// StartPullWatch starts following pull results from the current end of the events stream.
func StartPullWatch(ctx context.Context, b *bus.Bus, rolloutID, image, policy string, opts ...PullWatchOption) (*PullWatch, error) {
	var o pullWatchOptions
	for _, opt := range opts {
		opt(&o)
	}
	var start uint64
	if err := bus.Retry(ctx, func(ctx context.Context) error {
		info, err := b.Stream(ctx, events.EventsStream)
		start = info.LastSeq + 1
		return err
	}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second)); err != nil {
		return nil, fmt.Errorf("pull rollout: %w", err)
	}
	domains := o.domains
	if !o.domainsSet {
		var err error
		if domains, err = nodeDomains(ctx, b); err != nil {
			return nil, fmt.Errorf("pull rollout: %w", err)
		}
	}
	wctx, cancel := context.WithCancel(ctx)
	w := &PullWatch{b: b, rolloutID: rolloutID, image: image, policy: policy, domains: domains,
		results: map[string]events.PullResult{}, waiters: map[string]chan events.PullResult{},
		cancel: cancel, done: make(chan struct{})}
	go w.follow(wctx, start)
	return w, nil
}

// Stop stops following and waits for the follower to end.
func (w *PullWatch) Stop() {
	w.cancel()
	<-w.done
}

func (w *PullWatch) follow(ctx context.Context, next uint64) {
	defer close(w.done)
	for ctx.Err() == nil {
		tctx, restart := context.WithCancel(ctx)
		w.mu.Lock()
		w.restart, w.next, w.progress = restart, next, time.Now()
		w.starts++
		w.mu.Unlock()
		// Read notices a lost pull request within about 2 s (its heartbeats stop) and a lost server or
		// consumer by a gap or no responders, and makes its consumer anew; an error it returns, or a restart by nudge, is resumed from the message after the last one seen.
		err := w.b.Read(tctx, events.EventsStream, events.PullEventsFilter, func(m bus.StreamMsg) error {
			next = m.Seq + 1
			w.mu.Lock()
			w.next, w.progress = next, time.Now()
			w.mu.Unlock()
			if r, ok := pullResult(m); ok {
				w.deliver(r)
			}
			return nil
		}, bus.Follow(), bus.From(next))
		restart()
		if err != nil && ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
}

// pullResult decodes a terminal pull result event.
func pullResult(m bus.StreamMsg) (events.PullResult, bool) {
	ev, err := events.DecodeEventMsg(m.Header, m.Data)
	if err != nil {
		return events.PullResult{}, false
	}
	_, action, _, _ := events.ParseType(ev.Type)
	if action != events.ActionPulled && action != events.ActionFailed {
		return events.PullResult{}, false
	}
	var r events.PullResult
	if ev.DecodeData(&r) != nil || r.RequestID == "" {
		return events.PullResult{}, false
	}
	return r, true
}

// nudge is the follower's watchdog, told by a waiter's lookup that the events stream holds a result at seq.
// A follower that has not reached seq and has read nothing for followerStale is made anew: its ordered
// consumer can be lost with a server (Read notices that itself within seconds), and meanwhile every node of
// the rollout waits for its waiter's lookup, every 2 s. Once made anew it reads on
// from where it was; the waiters already answered by a lookup are gone, so nothing is delivered twice.
func (w *PullWatch) nudge(seq uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.restart == nil || w.next > seq || time.Since(w.progress) < followerStale {
		return
	}
	slog.Default().Warn("pull results follower read nothing while a result waited; following anew",
		"rollout", w.rolloutID, "stale", time.Since(w.progress).Round(time.Millisecond), "from_seq", w.next, "result_seq", seq)
	w.progress = time.Now() // one restart per stale period
	w.restart()
}

// lookup reads node's latest pull results directly (no consumer): the level-based fallback of a waiter, in
// case the follower is still catching up after a server loss, or stalled (nudge).
func (w *PullWatch) lookup(ctx context.Context, node, id string) (events.PullResult, bool) {
	// Bounded like an attempt: a reply lost with a server must not hold the waiter until the node timeout.
	ctx, cancel := context.WithTimeout(ctx, bus.AttemptTimeout)
	defer cancel()
	for _, action := range []string{events.ActionPulled, events.ActionFailed} {
		m, err := w.b.LastMsg(ctx, events.EventsStream, events.EventSubject(node, events.EntityPull, action))
		if err != nil {
			continue
		}
		if r, ok := pullResult(m); ok && r.RequestID == id {
			w.nudge(m.Seq)
			return r, true
		}
	}
	return events.PullResult{}, false
}

func (w *PullWatch) deliver(r events.PullResult) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ch, ok := w.waiters[r.RequestID]; ok {
		delete(w.waiters, r.RequestID)
		ch <- r
		return
	}
	// Kept for a waiter still to come: only this rollout's requests. The follower sees every node's pull
	// results (the kubelet's own pulls too); keeping those would grow with the fleet's pulls for the whole
	// rollout.
	if strings.HasPrefix(r.RequestID, w.rolloutID+".") {
		w.results[r.RequestID] = r
	}
}

func (w *PullWatch) wait(id string) chan events.PullResult {
	w.mu.Lock()
	defer w.mu.Unlock()
	ch := make(chan events.PullResult, 1)
	if r, ok := w.results[id]; ok {
		delete(w.results, id)
		ch <- r
		return ch
	}
	w.waiters[id] = ch
	return ch
}

// forget drops request id's waiter and any result kept for it.
func (w *PullWatch) forget(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.waiters, id)
	delete(w.results, id)
}

// Action is the rollout's node action.
func (w *PullWatch) Action() NodeAction {
	return func(ctx context.Context, node string) events.RolloutNodeResult {
		id := PullRequestID(w.rolloutID, node)
		ch := w.wait(id)
		req := events.PullRequest{ID: id, Image: w.image, Policy: w.policy, AllowPrivate: w.AllowPrivate, Enqueued: time.Now().UTC()}
		if err := bus.Retry(ctx, func(ctx context.Context) error {
			_, err := w.b.PublishCommand(ctx, w.pullSubject(node), id, req, nil)
			return err
		}, bus.MaxElapsed(transientRetryFor), bus.MaxWait(time.Second)); err != nil {
			// The request may be stored all the same (an ack lost with a server): withdraw it too.
			w.forget(id)
			w.withdraw(node, id)
			return events.RolloutNodeResult{Node: node, Error: err.Error()}
		}
		r, ok := w.await(ctx, ch, node, id)
		if !ok {
			w.withdraw(node, id)
			return events.RolloutNodeResult{Node: node, Error: ctx.Err().Error()}
		}
		nr := events.RolloutNodeResult{Node: node, OK: r.Error == "",
			Pull: &events.PullOutcome{ImageRef: r.ImageRef, Error: r.Error, Message: r.Message}}
		if r.Error != "" {
			nr.Error = r.Error
			if r.Message != "" {
				nr.Error += ": " + r.Message
			}
		}
		return nr
	}
}

// withdraw cancels request id on node, so a puller that gets it later does not act on a node the rollout
// has already counted as failed (best effort: a puller that already started finishes).
func (w *PullWatch) withdraw(node, id string) {
	if raw, err := json.Marshal(events.PullCancel{RequestID: id}); err == nil {
		_ = w.b.PublishRaw(events.CommandSubject(node, events.VerbPullCancel), raw)
	}
}

// await waits for request id's result: from the follower, or from a direct lookup every 2 s; false when
// ctx ends first.
func (w *PullWatch) await(ctx context.Context, ch <-chan events.PullResult, node, id string) (events.PullResult, bool) {
	check := time.NewTicker(2 * time.Second)
	defer check.Stop()
	for {
		select {
		case r := <-ch:
			return r, true
		case <-check.C:
			if r, ok := w.lookup(ctx, node, id); ok {
				w.forget(id)
				return r, true
			}
		case <-ctx.Done():
			w.forget(id)
			return events.PullResult{}, false
		}
	}
}
