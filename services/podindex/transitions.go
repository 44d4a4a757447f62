package podindex

// Applying one event (or dead-lettering it), and the registration events its transitions publish.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// deadLetterer stores a message that cannot be applied in the dead-letter stream, with its reason (bus.Bus).
type deadLetterer interface {
	DeadLetterMsg(ctx context.Context, stream, consumer string, m bus.StreamMsg, reason error) error
}

// refPublisher publishes the registration events and tells whether their acks can come (bus.Bus).
type refPublisher interface {
	PublishAll(ctx context.Context, evs []events.Event, opts ...bus.PublishOpt) error
	Connected() bool
}

// Reject dead-letters a malformed event with its reason, counts it and moves past it.
func (s *Service) rejectEvent(m bus.StreamMsg, reason error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.dead.DeadLetterMsg(ctx, events.EventsStream, events.PodIndexDeadLetters(s.cfg.Node), m, reason); err != nil {
		return err
	}
	eventsRejected.WithLabelValues(s.cfg.Node, rejectReason(reason)).Inc()
	s.log.Warn("pod event rejected", "subject", m.Subject, "stream_seq", m.Seq, "err", reason)
	s.state.skip(m.Seq)
	s.mu.Lock()
	s.writeNow = true // the snapshot moves past it, so a restart does not dead-letter it again
	s.mu.Unlock()
	s.requestFlush()
	return nil
}

// Apply applies one decoded event with stream sequence seq and publishes its registration events.
func (s *Service) applyEvent(seq uint64, ev PodEvent) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	trans := s.state.Apply(seq, ev)
	if c, ok := s.applied[ev.Action]; ok {
		c.Inc()
	} else {
		eventsApplied.WithLabelValues(s.cfg.Node, ev.Action).Inc()
	}
	s.since++
	if len(trans) > 0 {
		evs := make([]events.Event, 0, len(trans))
		for _, t := range trans {
			evs = append(evs, s.transitionEvent(seq, ev, t))
		}
		p := new(bus.Pending)
		// Async: nothing blocks, so no context bounds it; the flush waits for the acks.
		if err := s.refs.PublishAll(context.Background(), evs, bus.Async(p)); err != nil {
			// Kept pending, unconfirmed: the next flush publishes them again before it writes the snapshot.
			p = nil
			s.log.Warn("registration events publish failed", "stream_seq", seq, "err", err)
		}
		s.pending = append(s.pending, pendingEvents{evs: evs, p: p})
	}
	if s.since >= s.cfg.FlushEvents || len(s.pending) >= 512 {
		s.requestFlush()
	}
	return nil
}

// transitionEvent builds secret.registered (and the other three). Its id is derived from the pod event's
// sequence and the object, so replaying an event after a restart stores the same event once.
func (s *Service) transitionEvent(seq uint64, ev PodEvent, t Transition) events.Event {
	entity, action := events.EntitySecret, events.ActionUnregistered
	if t.Kind == events.KindConfigMap {
		entity = events.EntityConfigMap
	}
	count := 0
	if t.Registered {
		action, count = events.ActionRegistered, 1
	}
	refTransitions.WithLabelValues(s.cfg.Node, t.Kind, action).Inc()
	data := events.RefChange{Kind: t.Kind, Namespace: t.Namespace, Name: t.Name, Count: count,
		PodUID: string(t.Pod.uid), PodName: t.Pod.name, StreamSeq: seq}
	e, _ := events.New(s.cfg.Node, entity, action, data) // a RefChange always marshals
	h := sha256.Sum256([]byte(s.cfg.Node + "\x00" + strconv.FormatUint(seq, 10) + "\x00" + t.Kind + "\x00" +
		t.Namespace + "\x00" + t.Name + "\x00" + action + "\x00" + string(t.Pod.uid)))
	e.ID = hex.EncodeToString(h[:16])
	reason, msg := "Registered", fmt.Sprintf("%s %s/%s registered: first referenced by pod %s/%s", t.Kind,
		t.Namespace, t.Name, t.Pod.namespace, t.Pod.name)
	if !t.Registered {
		reason, msg = "Unregistered", fmt.Sprintf("%s %s/%s unregistered: no longer referenced (last by pod %s/%s)",
			t.Kind, t.Namespace, t.Name, t.Pod.namespace, t.Pod.name)
	}
	return e.WithKube("", reason, msg, &events.ObjectRef{Kind: "Pod", Namespace: t.Pod.namespace, Name: t.Pod.name, UID: string(t.Pod.uid)})
}

// pendingEvents are transition events published asynchronously and not yet confirmed.
type pendingEvents struct {
	evs []events.Event
	p   *bus.Pending
}
