package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/imagefleet/imagefleet/bus"
)

// adapt sets the next period from the rate the TTL bucket took between this node's last two thin records
// (their revisions are the bucket's sequence: every node's writes in between are counted).
func (h *Heartbeat) adapt(alive *bus.KV, rev uint64, at time.Time) {
	prevRev, prevAt := h.lastRev, h.lastAt
	h.lastRev, h.lastAt = rev, at
	if h.cfg.MaxRate <= 0 || prevRev == 0 || rev <= prevRev || !at.After(prevAt) {
		return
	}
	limit := h.cfg.Period
	if ttl, ok := alive.TTL(); ok && ttl > 0 {
		limit = max(limit, ttl/time.Duration(defaultLostAfterPeriods))
	}
	rate := float64(rev-prevRev) / at.Sub(prevAt).Seconds()
	next := stretchedPeriod(h.period, h.cfg.Period, limit, rate, h.cfg.MaxRate)
	if next != h.period {
		// Said at Info when the node leaves its configured period or comes back to it; the steps between
		// (a fleet settling) at Debug, or 10,000 nodes would log a line each every period or two.
		level := slog.LevelDebug
		if h.period == h.cfg.Period || next == h.cfg.Period {
			level = slog.LevelInfo
		}
		h.cfg.Logger.Log(context.Background(), level, "heartbeat period changed", "node", h.cfg.Node, "period", next,
			"was", h.period, "bucket_rate", fmt.Sprintf("%.0f/s", rate), "max_rate", h.cfg.MaxRate)
		h.period = next
	}
}

// stretchedPeriod is the next period of a node beating every cur whose bucket took rate heartbeats per
// second: cur x sqrt(rate / maxRate) in whole seconds when base is, cur itself when that is within a tenth
// of cur (a period's rate is noisy by a few writes), then kept between base and limit. The tenth is taken
// before the bounds: taken after them, a period that came within a tenth below the limit stayed there (1.97
// s of a 2 s limit, at three times maxRate) however far the rate was over maxRate.
//
// Every node applying the full correction, cur x rate / maxRate, would bring the fleet to maxRate at once
// if the rate were current; it is a period old, so the nodes overshot together (10,000 hollow agents
// spread over 10-29 s, 680 writes/s two minutes after they started). Half the correction in log terms
// settles within a few periods instead: a factor 2 off becomes 1.41, 1.19, 1.09.
func stretchedPeriod(cur, base, limit time.Duration, rate, maxRate float64) time.Duration {
	want := time.Duration(float64(cur) * math.Sqrt(rate/maxRate))
	if base >= time.Second {
		want = want.Round(time.Second)
	}
	if d := want - cur; d < cur/10 && -d < cur/10 {
		want = cur
	}
	return min(max(want, base), max(limit, base))
}
