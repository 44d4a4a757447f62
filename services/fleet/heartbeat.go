package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// HeartbeatConfig configures the heartbeat worker.
type HeartbeatConfig struct {
	// Node is the node name (required).
	Node string
	// Labels are the node's labels, matched by rollout selectors (default none).
	Labels map[string]string
	// Period is the heartbeat period (default 10s).
	Period time.Duration
	// TTL is how long the heartbeat key lives without a new heartbeat (default: 3 periods, at least
	// defaultHeartbeatTTL while MaxRate stretches the period). It is the TTL of the imagefleet-nodes bucket,
	// fixed by whichever agent creates it first (`imagefleet bus init` in production).
	TTL time.Duration
	// MaxRate is how many heartbeats per second the fleet's TTL bucket should take at most (default
	// DefaultHeartbeatMaxRate; negative: never stretch). Each heartbeat measures the rate the bucket takes
	// from the revisions of its own two last writes; above MaxRate the period stretches so that the fleet's
	// rate comes back to it, and it shrinks back to Period as the rate falls: never below Period, never
	// above a third of the bucket's TTL, so the key outlives two missed heartbeats.
	MaxRate float64
	// AgentVersion is reported as is (default "dev").
	AgentVersion string
	// Workers are the agent's worker names, reported as is.
	Workers []string
	// FullEvery writes the full record (labels, runtime, workers, image filesystem usage) into the last-seen
	// bucket at least every FullEvery-th heartbeat; in between it is written only when it changed (usage:
	// by at least 1% of the capacity), and each heartbeat writes only the thin alive record (default 30: five
	// minutes at the default period, as the kubelet's nodeStatusReportFrequency; 1: every heartbeat, the
	// previous release's behaviour).
	FullEvery int
	// Statfs returns the capacity and available bytes of the filesystem holding a path (default cri.Statfs).
	Statfs func(path string) (capacity, available int64, err error)
	// Clock returns now (default time.Now).
	Clock func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// heartbeatRuntime is the part of the CRI client the heartbeat reads.
type heartbeatRuntime interface {
	Version(ctx context.Context) (name, version string, err error)
	ImageFsInfo(ctx context.Context) ([]cri.FsInfo, error)
}

// defaultFullEvery is how many heartbeats may pass between two writes of an unchanged full record.
const defaultFullEvery = 30

// DefaultHeartbeatMaxRate is the heartbeats per second the registry's TTL bucket takes before the nodes
// stretch their period: 500, what the kubelets of Kubernetes' largest supported cluster (5,000 nodes) write
// renewing their node leases every 10 s. A fleet of up to 5,000 nodes heartbeats every 10 s; 10,000 every 20 s.
const DefaultHeartbeatMaxRate = 500

// defaultHeartbeatTTL is the TTL of the heartbeat bucket `imagefleet bus init` makes: 3 periods of 30 s, the
// longest period the default rate stretches to (15,000 nodes).
const defaultHeartbeatTTL = 90 * time.Second

// Heartbeat announces its node into the registry every period: a thin record (node, time, period) into the
// TTL bucket every period, the full record into the last-seen bucket when it changed or every FullEvery-th
// period. The registry reads both (and the previous release's full record in both buckets).
type Heartbeat struct {
	cfg     HeartbeatConfig
	rt      heartbeatRuntime
	b       *bus.Bus
	started time.Time

	// Only the goroutine calling beat touches these: Run's loop, or one Beat at a time.
	lastFull  events.NodeInfo // the last full record written (zero: none yet)
	sinceFull int             // heartbeats since it was written
	period    time.Duration   // the period now: cfg.Period, or stretched (MaxRate)
	lastRev   uint64          // the revision of the last thin record written (0: none, or the beat failed)
	lastAt    time.Time       // when it was written

	// ready is closed once Run's first heartbeat is written (Ready).
	ready     chan struct{}
	readyOnce sync.Once
}

// NewHeartbeat validates cfg and returns the worker.
func NewHeartbeat(cfg HeartbeatConfig, rt heartbeatRuntime, b *bus.Bus) (*Heartbeat, error) {
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, fmt.Errorf("heartbeat: %w", err)
	}
	if cfg.Period < 0 {
		return nil, fmt.Errorf("heartbeat period %v must not be negative", cfg.Period)
	}
	if cfg.Period == 0 {
		cfg.Period = DefaultHeartbeatPeriod
	}
	if cfg.MaxRate == 0 {
		cfg.MaxRate = DefaultHeartbeatMaxRate
	}
	if cfg.TTL == 0 {
		cfg.TTL = time.Duration(defaultLostAfterPeriods) * cfg.Period
		if cfg.MaxRate > 0 {
			cfg.TTL = max(cfg.TTL, defaultHeartbeatTTL)
		}
	}
	if cfg.FullEvery < 0 {
		return nil, fmt.Errorf("heartbeat full-every %d must not be negative", cfg.FullEvery)
	}
	if cfg.FullEvery == 0 {
		cfg.FullEvery = defaultFullEvery
	}
	if cfg.TTL < cfg.Period {
		return nil, fmt.Errorf("heartbeat ttl %v must be at least the period %v", cfg.TTL, cfg.Period)
	}
	for k, v := range cfg.Labels {
		if _, err := ParseLabels(k + "=" + v); err != nil {
			return nil, fmt.Errorf("heartbeat: %w", err)
		}
	}
	if rt == nil || b == nil {
		return nil, fmt.Errorf("heartbeat needs a runtime and a bus")
	}
	if cfg.AgentVersion == "" {
		cfg.AgentVersion = "dev"
	}
	if cfg.Statfs == nil {
		cfg.Statfs = cri.Statfs
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Labels = maps.Clone(cfg.Labels)
	return &Heartbeat{cfg: cfg, rt: rt, b: b, started: cfg.Clock().UTC(), period: cfg.Period,
		ready: make(chan struct{})}, nil
}

// Ready is closed once Run's first heartbeat is written: the registry lists the node as Ready from then on.
// While the buckets or the writes fail, Run retries each period and Ready stays open.
func (h *Heartbeat) Ready() <-chan struct{} { return h.ready }

// Run heartbeats until ctx ends. A failed heartbeat is logged and retried at the next period: the node is
// shown as lost meanwhile, which is the truth.
//
// A heartbeat is given one period. Its writes retry a transient failure (a stream leader lost with its
// server) for up to 20 s each, and a write retried that long stores the time the heartbeat was made, as
// old as the wait, while the beats behind it wait too: a live node can read as lost for it. Given up at the
// period, the next heartbeat writes the time it is sent.
func (h *Heartbeat) Run(ctx context.Context) error {
	alive, seen, err := h.buckets(ctx)
	if err != nil {
		return err
	}
	t := time.NewTicker(h.period)
	defer t.Stop()
	for {
		period := h.period
		bctx, cancel := context.WithTimeout(ctx, period)
		_, err := h.beat(bctx, alive, seen)
		cancel()
		if err != nil && ctx.Err() == nil {
			h.cfg.Logger.Warn("heartbeat failed", "node", h.cfg.Node, "err", err)
		}
		if err == nil {
			h.readyOnce.Do(func() { close(h.ready) })
		}
		if h.period != period {
			t.Reset(h.period)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Info reads the runtime and builds the heartbeat (runtime problems go into Error, not into err).
func (h *Heartbeat) Info(ctx context.Context) events.NodeInfo {
	info := events.NodeInfo{Node: h.cfg.Node, Labels: h.cfg.Labels, AgentVersion: h.cfg.AgentVersion,
		Workers: h.cfg.Workers, Started: h.started, Period: events.Duration{Duration: h.period},
		JSDomain: h.b.PullDomain()}
	var problems []string
	name, version, err := h.rt.Version(ctx)
	if err != nil {
		problems = append(problems, err.Error())
	}
	info.RuntimeName, info.RuntimeVersion = name, version
	fss, err := h.rt.ImageFsInfo(ctx)
	switch {
	case err != nil:
		problems = append(problems, err.Error())
	case len(fss) > 0:
		info.ImageFs.Mountpoint = fss[0].Mountpoint
		info.ImageFs.UsedBytes = int64(fss[0].UsedBytes)
		if fss[0].Mountpoint != "" {
			c, a, err := h.cfg.Statfs(fss[0].Mountpoint)
			if err != nil {
				problems = append(problems, err.Error())
			}
			info.ImageFs.CapacityBytes, info.ImageFs.AvailableBytes = c, a
		}
	}
	if len(problems) > 0 {
		info.Error = fmt.Sprint(problems)
	}
	info.Heartbeat = h.cfg.Clock().UTC()
	return info
}

func (h *Heartbeat) beat(ctx context.Context, alive, seen *bus.KV) (events.NodeInfo, error) {
	info := h.Info(ctx)
	key := events.NodeToken(h.cfg.Node)
	// The full record first: a reader that finds the alive key finds the node's record too.
	if h.lastFull.Node == "" || h.sinceFull+1 >= h.fullEvery() || fullChanged(h.lastFull, info) {
		raw, err := json.Marshal(info)
		if err != nil {
			return info, fmt.Errorf("marshal heartbeat: %w", err)
		}
		if _, err := seen.Put(ctx, key, raw); err != nil {
			return info, fmt.Errorf("heartbeat: %w", err)
		}
		h.lastFull, h.sinceFull = info, 0
	} else {
		h.sinceFull++
	}
	raw, err := json.Marshal(events.NodeAlive{Node: info.Node, Heartbeat: info.Heartbeat, Period: info.Period})
	if err != nil {
		return info, fmt.Errorf("marshal heartbeat: %w", err)
	}
	rev, err := alive.Put(ctx, key, raw)
	if err != nil {
		h.lastRev = 0
		return info, fmt.Errorf("heartbeat: %w", err)
	}
	h.adapt(alive, rev, h.cfg.Clock())
	return info, nil
}

// fullEvery is FullEvery counted in periods of the configured length: a stretched period writes the
// unchanged full record as often in time (5 minutes by default), in fewer heartbeats.
func (h *Heartbeat) fullEvery() int {
	if h.period <= h.cfg.Period {
		return h.cfg.FullEvery
	}
	every := time.Duration(h.cfg.FullEvery) * h.cfg.Period
	return max(1, int((every+h.period-1)/h.period))
}

// fullChanged reports whether the full record moved enough since it was last written to be written again:
// anything but the heartbeat time, the period and the usage, or the usage by at least 1% of the capacity
// (1 MiB when the capacity is unknown). The period is the thin record's to tell (the registry takes it from
// there): one that stretches as a fleet settles would otherwise write the full record at each step.
func fullChanged(old, cur events.NodeInfo) bool {
	if old.Node != cur.Node || !maps.Equal(old.Labels, cur.Labels) || old.RuntimeName != cur.RuntimeName ||
		old.RuntimeVersion != cur.RuntimeVersion || old.AgentVersion != cur.AgentVersion ||
		!slices.Equal(old.Workers, cur.Workers) || !old.Started.Equal(cur.Started) ||
		old.Error != cur.Error || old.ImageFs.Mountpoint != cur.ImageFs.Mountpoint ||
		old.ImageFs.CapacityBytes != cur.ImageFs.CapacityBytes {
		return true
	}
	step := max(cur.ImageFs.CapacityBytes/100, 1<<20)
	moved := func(a, b int64) bool { return a-b >= step || b-a >= step }
	return moved(old.ImageFs.UsedBytes, cur.ImageFs.UsedBytes) || moved(old.ImageFs.AvailableBytes, cur.ImageFs.AvailableBytes)
}
