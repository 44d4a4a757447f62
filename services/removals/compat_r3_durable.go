// Compatibility path: the removals durable of the previous layout.
//
// Agents of the previous layout consume every event of their node (events.NodeEvents) through the durable
// removals-<node> with the events stream's replicas (R3 on a three-server cluster, a Raft group per node).
// The worker takes it over under the same name: it updates it in place to one replica and the node's
// image.vanished filter (nats-server allows both changes; the consumer keeps its ack floor, so an event
// handled before is not reported again and one published since is not missed). When the update is refused
// (the server refuses a change of storage: a durable in memory storage), it deletes the consumer and makes
// it anew after its ack floor.
//
// Remove when: no removals durable of the previous layout remains (every agent ran the current worker once;
// docs/upgrading.md, "Compatibility paths").

package removals

import (
	"context"
	"fmt"
	"slices"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// previousRelease reports whether st is the removals durable of the previous layout: more than one replica
// (0 is the stream's) or another filter than the node's image.vanished events.
func (s *Service) previousRelease(st bus.ConsumerState) bool {
	return st.Replicas != 1 || !slices.Equal(st.Filters, []string{s.subject(events.ActionVanished)})
}

// takeOver brings the previous layout's durable st to the current settings, in place or, refused, by making
// it anew after its ack floor.
func (s *Service) takeOver(ctx context.Context, st bus.ConsumerState) error {
	durable := events.RemovalsDurable(s.cfg.Node)
	cfg := s.consumerConfig()
	cfg.Started = nil
	err := s.bus.EnsureConsumer(ctx, cfg)
	if err == nil {
		s.log.Info("removals consumer of the previous layout updated in place: one replica, the node's vanished events",
			"durable", durable, "replicas_before", st.Replicas, "filters_before", st.Filters, "ack_floor", st.AckFloor)
		return nil
	}
	if ctx.Err() != nil || bus.IsConsumerOffline(err) {
		return err
	}
	s.log.Warn("removals consumer of the previous layout not updated in place; making it anew after its ack floor",
		"durable", durable, "ack_floor", st.AckFloor, "err", err)
	if err := s.bus.DeleteConsumer(ctx, events.EventsStream, durable); err != nil {
		return fmt.Errorf("take over %s: %w", durable, err)
	}
	s.startSeq = st.AckFloor + 1
	return nil
}
