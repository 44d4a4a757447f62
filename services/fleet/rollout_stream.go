package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// EnsureRolloutStream creates or updates the rollout stream.
func EnsureRolloutStream(ctx context.Context, b *bus.Bus, replicas int) error {
	return b.EnsureStream(ctx, bus.StreamConfig{Name: events.RolloutStream, Subjects: []string{events.RolloutSubjects},
		MaxAge: 30 * 24 * time.Hour, MaxBytes: 1 << 30, Replicas: replicas})
}

// rolloutState is what the rollout stream already holds about a rollout.
type rolloutState struct {
	started *events.RolloutStarted
	claims  map[string]events.RolloutClaim
	results map[string]events.RolloutNodeResult
}

// actsOnAny reports whether a run would act on one of nodes: one with neither an outcome nor a claim
// recorded. A batch of a resumed rollout whose nodes all ended before only reports their outcomes again.
func (st rolloutState) actsOnAny(nodes []string) bool {
	for _, n := range nodes {
		_, done := st.results[n]
		_, claimed := st.claims[n]
		if !done && !claimed {
			return true
		}
	}
	return false
}

// LoadRollout reads everything recorded about rollout id.
func LoadRollout(ctx context.Context, b *bus.Bus, id string) (*events.RolloutStarted, map[string]events.RolloutClaim, map[string]events.RolloutNodeResult, error) {
	st, err := loadRollout(ctx, b, id)
	if err != nil {
		return nil, nil, nil, err
	}
	return st.started, st.claims, st.results, nil
}

// LoadRolloutStarted reads only the start record of rollout id (nil when it never started): its plan and
// settings, in one lookup however many nodes the rollout has recorded. A driver resuming a rollout needs no
// more; the engine's Run reads the claims and outcomes itself.
func LoadRolloutStarted(ctx context.Context, b *bus.Bus, id string) (*events.RolloutStarted, error) {
	started, err := firstRecord[events.RolloutStarted](ctx, b, events.RolloutSubject(id, events.RolloutStartedKind, ""))
	if err != nil {
		return nil, fmt.Errorf("load rollout %s: %w", id, err)
	}
	return started, nil
}

// firstRecord reads the first record on subject of the rollout stream that decodes as a T (nil when there
// is none): a damaged record is skipped, as loadRollout does.
func firstRecord[T any](ctx context.Context, b *bus.Bus, subject string) (*T, error) {
	var first *T
	err := b.Read(ctx, events.RolloutStream, subject, func(m bus.StreamMsg) error {
		var v T
		if json.Unmarshal(m.Data, &v) != nil {
			return nil
		}
		first = &v
		return bus.StopReading
	})
	return first, err
}

func loadRollout(ctx context.Context, b *bus.Bus, id string) (rolloutState, error) {
	st := rolloutState{claims: map[string]events.RolloutClaim{}, results: map[string]events.RolloutNodeResult{}}
	// A rollout that never started has nothing to read: one direct lookup instead of a scan.
	if _, err := b.LastMsg(ctx, events.RolloutStream, events.RolloutSubject(id, events.RolloutStartedKind, "")); err != nil {
		if errors.Is(err, bus.ErrNoMessage) {
			return st, nil
		}
		return st, fmt.Errorf("load rollout %s: %w", id, err)
	}
	prefix := events.Prefix + ".fleet.rollout." + id + "."
	err := b.Read(ctx, events.RolloutStream, events.RolloutFilter(id), func(m bus.StreamMsg) error {
		kind, _, _ := strings.Cut(strings.TrimPrefix(m.Subject, prefix), ".")
		for _, ev := range rolloutEvents(kind, m) { // the first record of each node counts
			switch {
			case ev.Started != nil && st.started == nil:
				st.started = ev.Started
			case ev.Claim != nil:
				if _, ok := st.claims[ev.Claim.Node]; !ok {
					st.claims[ev.Claim.Node] = *ev.Claim
				}
			case ev.Node != nil:
				if _, ok := st.results[ev.Node.Node]; !ok {
					st.results[ev.Node.Node] = *ev.Node
				}
			}
		}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("load rollout %s: %w", id, err)
	}
	return st, nil
}

func (r *Rollout) publish(ctx context.Context, subject, id string, v any) (uint64, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("marshal %s: %w", subject, err)
	}
	return r.b.PublishStored(ctx, bus.RawMsg{Subject: subject, MsgID: r.cfg.ID + "." + id, Data: raw,
		Header: map[string]string{"content-type": "application/json"}})
}

func (r *Rollout) publishFirst(ctx context.Context, subject, id string, v any) (bool, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return false, fmt.Errorf("marshal %s: %w", subject, err)
	}
	return r.b.PublishFirst(ctx, bus.RawMsg{Subject: subject, MsgID: r.cfg.ID + "." + id, Data: raw,
		Header: map[string]string{"content-type": "application/json"}})
}
