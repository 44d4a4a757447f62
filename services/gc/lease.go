package gc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// The node's GC pass lease. GC executor replicas of one node (imagefleet agent --workers gc on several hosts,
// one queue group) each serialise their own passes with Service.mu; the lease serialises them across
// replicas, and the NATS server enforces it: the node's key in events.GCLeaseBucket is taken with a
// create-only write (or a compare-and-set over a released value), renewed with compare-and-set writes every
// TTL/3 while the pass runs, and marked released, with the pass's result, at its end. A holder that dies
// stops renewing and its key expires with the bucket's TTL.
//
// A replica that finds the lease held:
//   - periodic pass or usage check: skips (the running pass does the work; the next check looks again);
//   - manual or pull-triggered request: waits (polling the key, at most Config.LeaseWait) for the running
//     pass to end and answers with that pass's result when it is the same kind of pass (see shareable);
//     otherwise it takes the lease once free and runs its own pass. When the wait runs out the answer is a
//     LeaseHeldError: "a GC pass is already running on node N (held by ...)".
//
// Dry runs take no lease: they remove nothing.

// DefaultLeaseTTL is the lease's TTL (the bucket's max age): how long a dead holder blocks the node's passes.
const DefaultLeaseTTL = 30 * time.Second

// maxLeaseValue bounds the released value (NATS's default max payload is 1 MiB).
const maxLeaseValue = 512 << 10

// DefaultLeaseWait bounds how long a manual or pull-triggered request waits for another replica's pass.
const DefaultLeaseWait = 5 * time.Minute

// leaseValue is the value of a node's key in events.GCLeaseBucket (JSON).
type leaseValue struct {
	Pass      string    `json:"pass"`                // random id of the pass
	Holder    string    `json:"holder"`              // the replica: host@pidns/pid/random
	Trigger   string    `json:"trigger"`             // periodic, usage, pull, manual
	AllUnused bool      `json:"allUnused,omitempty"` // gc --all-unused
	Overrides bool      `json:"overrides,omitempty"` // the request changed the policy
	Started   time.Time `json:"started"`
	// Released is set at the pass's end, with its Result: the key is free for the next pass.
	Released bool             `json:"released,omitempty"`
	Result   *events.GCResult `json:"result,omitempty"`
}

// LeaseHeldError is the answer to a manual or pull-triggered request that waited Waited for another
// replica's pass without it ending.
type LeaseHeldError struct {
	Node, Holder, Trigger string
	Since                 time.Time
	Waited                time.Duration
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("a GC pass is already running on node %s (held by %s, %s pass started %s); it did not end within %v",
		e.Node, e.Holder, e.Trigger, e.Since.UTC().Format(time.RFC3339), e.Waited.Round(time.Millisecond))
}

// errLeaseHeld is returned to the periodic loop and the usage check when another replica holds the lease.
var errLeaseHeld = errors.New("another replica holds the node's GC pass lease")

// errLeaseLost cancels a pass whose lease could not be renewed.
var errLeaseLost = errors.New("lost the node's GC pass lease (not renewed within its TTL)")

// Lease outcomes, the values of imagefleet_gc_lease_total's outcome label.
const (
	leaseAcquired    = "acquired"    // took the lease and ran the pass
	leaseSkipped     = "skipped"     // periodic or usage: another replica's pass runs
	leaseShared      = "shared"      // answered with another replica's pass result
	leaseWaited      = "waited"      // waited for another replica's pass, then ran its own
	leaseTimeout     = "timeout"     // waited LeaseWait in vain: LeaseHeldError
	leaseUnavailable = "unavailable" // the lease could not be read or written: ran without it
	leaseLost        = "lost"        // the lease was not renewed: the pass was stopped
)

var leaseOutcomes = []string{leaseAcquired, leaseSkipped, leaseShared, leaseWaited, leaseTimeout, leaseUnavailable, leaseLost}

type leaseMetrics struct {
	total   *prometheus.CounterVec   // trigger, outcome
	wait    *prometheus.HistogramVec // trigger
	waiting *prometheus.GaugeVec     // trigger
}

func newLeaseMetrics(reg prometheus.Registerer) (*leaseMetrics, error) {
	total, err := promreg.RegisterOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "imagefleet", Subsystem: "gc",
		Name: "lease_total", Help: "GC pass lease outcomes per pass attempt, by trigger and outcome (acquired, skipped, shared, waited, timeout, unavailable, lost)."},
		[]string{"trigger", "outcome"}))
	if err != nil {
		return nil, err
	}
	wait, err := promreg.RegisterOrReuse(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "imagefleet", Subsystem: "gc",
		Name: "lease_wait_seconds", Help: "Time a manual or pull-triggered GC request waited for another replica's pass.",
		Buckets: []float64{0.1, 0.5, 1, 5, 10, 30, 60, 120, 300}}, []string{"trigger"}))
	if err != nil {
		return nil, err
	}
	for _, tr := range []string{events.GCTriggerPeriodic, events.GCTriggerUsage, events.GCTriggerPull, events.GCTriggerManual} {
		for _, o := range leaseOutcomes {
			total.WithLabelValues(tr, o)
		}
	}
	waiting, err := promreg.RegisterOrReuse(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "imagefleet", Subsystem: "gc",
		Name: "lease_waiting", Help: "Manual or pull-triggered GC requests now waiting for another replica's pass."}, []string{"trigger"}))
	if err != nil {
		return nil, err
	}
	for _, tr := range []string{events.GCTriggerPull, events.GCTriggerManual} {
		wait.WithLabelValues(tr)
		waiting.WithLabelValues(tr)
	}
	return &leaseMetrics{total: total, wait: wait, waiting: waiting}, nil
}

// leaser takes and keeps one node's lease.
type leaser struct {
	bus    *bus.Bus
	node   string
	key    string
	holder string
	ttl    time.Duration
	poll   time.Duration
	log    *slog.Logger

	mu sync.Mutex
	// kv is the open bucket (nil: not open). open and acquire set and clear it under mu; keep, release and
	// wait read it without mu, which is safe because passes run one at a time (Service.mu) and warm stores
	// it only while it is nil, so no pass is between its open and its use when it changes.
	kv       *bus.KV
	nextOpen time.Time
}

func newLeaser(b *bus.Bus, node string, ttl time.Duration, log *slog.Logger) *leaser {
	return &leaser{bus: b, node: node, key: events.NodeToken(node), ttl: ttl, poll: min(ttl/10, 100*time.Millisecond),
		holder: fmt.Sprintf("%s/%d/%s", processSpace(), os.Getpid(), randomID(4)), log: log}
}

// processSpace names where this process's pid means something: the host name and the pid namespace
// ("host@pid:[4026531836]"); "" parts when unknown.
func processSpace() string {
	host, _ := os.Hostname()
	ns, _ := os.Readlink("/proc/self/ns/pid")
	return host + "@" + ns
}

// deadHere reports whether holder (host@pidns/pid/random) is a process of this host and pid namespace that
// no longer runs: a replica restarted after SIGKILL takes its own dead predecessor's lease at once instead of
// waiting out the TTL. A holder elsewhere, or one whose namespace is unknown, is never judged dead here.
func (l *leaser) deadHere(holder string) bool {
	space, rest, ok := strings.Cut(holder, "/")
	if !ok || !strings.Contains(space, "@pid:") || space != processSpace() || holder == l.holder {
		return false
	}
	pidText, _, ok := strings.Cut(rest, "/")
	pid, err := strconv.Atoi(pidText)
	if !ok || err != nil || pid <= 0 {
		return false
	}
	if pid == os.Getpid() {
		return false // another executor in this process (a restarted container has a new pid namespace)
	}
	err = syscall.Kill(pid, 0)
	return errors.Is(err, syscall.ESRCH)
}

func randomID(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// EnsureLeaseBucket creates the GC pass lease bucket with DefaultLeaseTTL: what `imagefleet bus init` runs
// with the admin identity (node identities may not create buckets).
func EnsureLeaseBucket(ctx context.Context, b *bus.Bus) error {
	_, err := b.KV(ctx, leaseBucketConfig(DefaultLeaseTTL))
	return err
}

func leaseBucketConfig(ttl time.Duration) bus.KVConfig {
	return bus.KVConfig{Bucket: events.GCLeaseBucket, Description: "image GC pass lease per node", TTL: ttl}
}

// open returns the bucket, opening (or, where allowed, creating) it at most once a minute after a failure.
func (l *leaser) open(ctx context.Context) (*bus.KV, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.kv != nil {
		return l.kv, nil
	}
	if time.Now().Before(l.nextOpen) {
		return nil, errors.New("lease bucket unavailable (retried once a minute)")
	}
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var kv *bus.KV
	var err error
	if l.ttl == DefaultLeaseTTL {
		// The bucket `imagefleet bus init` made (or an agent before us) has this TTL: open it with one
		// lookup. bus.KV would read the bucket's status as well to compare its settings, a second stream
		// info request per node (both on the pass's path: 20,000 at a 10,000-node fleet GC's first pass).
		// Any failure (no bucket yet, a lookup that timed out) takes bus.KV's way, which creates a missing
		// bucket and retries a transient failure, as every open did before.
		kv, err = l.bus.KVExisting(octx, events.GCLeaseBucket)
	}
	if l.ttl != DefaultLeaseTTL || err != nil {
		kv, err = l.bus.KV(octx, leaseBucketConfig(l.ttl))
	}
	if err != nil {
		l.nextOpen = time.Now().Add(time.Minute)
		return nil, err
	}
	l.kv = kv
	return kv, nil
}

// warm opens the bucket when the executor starts, so that the first leased pass makes no stream lookup of
// its own: a fleet GC soon after the fleet's agents started would otherwise make one per node inside the
// rollout, all on the bucket's stream leader (10,000 at 10,000 nodes). It only binds to the bucket
// `imagefleet bus init` made, with the default TTL: making a missing bucket, or comparing another TTL's
// settings, stays with the first pass's open (a node identity may not make it, and a refused create at
// every start would be noise). It holds mu only to read and to store: a pass that starts meanwhile opens
// the bucket itself, within its own deadline. A failure here sets no wait; the first pass opens the
// bucket, as it did before.
func (l *leaser) warm(ctx context.Context) {
	if l.ttl != DefaultLeaseTTL {
		return
	}
	l.mu.Lock()
	skip := l.kv != nil || time.Now().Before(l.nextOpen) // open already, or a failure is being waited out
	l.mu.Unlock()
	if skip {
		return
	}
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	kv, err := l.bus.KVExisting(octx, events.GCLeaseBucket)
	if err != nil {
		if ctx.Err() == nil {
			l.log.Debug("image GC pass lease bucket not opened at start; the first pass opens it", "err", err)
		}
		return
	}
	l.mu.Lock()
	// Not over a pass's own open, nor into a wait a failed acquire set meanwhile.
	if l.kv == nil && !time.Now().Before(l.nextOpen) {
		l.kv = kv
	}
	l.mu.Unlock()
}

// acquire takes the lease with v, or returns the value of the pass holding it. It gives up after 5 s; after
// a failure (other than the caller's context) the lease is not tried again for a minute, so a server that
// refuses it (an old permission set) delays one pass, not each.
func (l *leaser) acquire(ctx context.Context, v leaseValue) (uint64, *leaseValue, error) {
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rev, held, err := l.tryAcquire(actx, v)
	if err != nil && ctx.Err() == nil {
		l.mu.Lock()
		l.kv, l.nextOpen = nil, time.Now().Add(time.Minute)
		l.mu.Unlock()
	}
	return rev, held, err
}

func (l *leaser) tryAcquire(ctx context.Context, v leaseValue) (uint64, *leaseValue, error) {
	kv, err := l.open(ctx)
	if err != nil {
		return 0, nil, err
	}
	data, err := json.Marshal(v)
	if err != nil {
		return 0, nil, err
	}
	for range 5 {
		rev, err := kv.Create(ctx, l.key, data)
		if err == nil {
			return rev, nil, nil
		}
		if !errors.Is(err, bus.ErrConflict) {
			return 0, nil, err
		}
		cur, crev, err := l.get(ctx, kv)
		switch {
		case errors.Is(err, bus.ErrKeyNotFound):
			continue // expired in between
		case err != nil:
			return 0, nil, err
		case !cur.Released && !l.deadHere(cur.Holder):
			return 0, &cur, nil
		}
		rev, err = kv.Update(ctx, l.key, data, crev)
		if err == nil {
			if !cur.Released {
				l.log.Warn("image GC pass lease taken over from a dead holder on this host", "holder", cur.Holder, "since", cur.Started)
			}
			return rev, nil, nil
		}
		if !errors.Is(err, bus.ErrConflict) {
			return 0, nil, err
		}
	}
	return 0, nil, errors.New("the GC pass lease changed hands five times in a row")
}

// get reads the lease. An unreadable value reads as held by "unknown" (it expires with the TTL).
func (l *leaser) get(ctx context.Context, kv *bus.KV) (leaseValue, uint64, error) {
	data, rev, err := kv.Get(ctx, l.key)
	if err != nil {
		return leaseValue{}, 0, err
	}
	var v leaseValue
	if err := json.Unmarshal(data, &v); err != nil {
		return leaseValue{Holder: "unknown", Pass: "unreadable-" + fmt.Sprint(rev)}, rev, nil
	}
	return v, rev, nil
}

// keep renews the lease every TTL/3 until ctx ends; when it cannot (the key changed hands, or no renewal
// succeeded for half the TTL) it calls lost once and returns. It returns the last revision.
func (l *leaser) keep(ctx context.Context, rev uint64, v leaseValue, lost func()) uint64 {
	data, _ := json.Marshal(v)
	tick := time.NewTicker(l.ttl / 3)
	defer tick.Stop()
	lastOK := time.Now()
	for {
		select {
		case <-ctx.Done():
			return rev
		case <-tick.C:
		}
		rctx, cancel := context.WithTimeout(ctx, l.ttl/3)
		nrev, err := l.kv.Update(rctx, l.key, data, rev)
		cancel()
		if err == nil {
			rev, lastOK = nrev, time.Now()
			continue
		}
		if ctx.Err() != nil {
			return rev
		}
		if errors.Is(err, bus.ErrConflict) || time.Since(lastOK) > l.ttl/2 {
			l.log.Error("image GC pass lease lost, stopping the pass", "err", err)
			lost()
			return rev
		}
		l.log.Warn("image GC pass lease renewal failed, retrying", "err", err)
	}
}

// release marks the lease released with the pass's result, so waiting requests can share it.
func (l *leaser) release(ctx context.Context, rev uint64, v leaseValue, res events.GCResult) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	v.Released, v.Result = true, &res
	data, err := json.Marshal(v)
	if err == nil && len(data) > maxLeaseValue {
		// A node with thousands of images: the kept images are left out of the shared result (the pass's
		// own answer and its gc.finished event carry them).
		short := res
		short.Skipped = []events.GCSkipped{}
		v.Result = &short
		data, err = json.Marshal(v)
	}
	if err == nil {
		if _, err = l.kv.Update(ctx, l.key, data, rev); err == nil {
			return
		}
	}
	if errors.Is(err, bus.ErrConflict) {
		return // another replica took the key after ours expired
	}
	l.log.Warn("image GC pass lease: release with the result failed, deleting the key", "err", err)
	if err := l.kv.Delete(ctx, l.key); err != nil {
		l.log.Warn("image GC pass lease: delete failed (it expires with its TTL)", "err", err)
	}
}

// wait polls the lease until the pass held (or a pass that took the lease after it) is released, and
// returns the released value with its result; nil when the key is gone (its holder died and it expired). A
// pass released while the request waited ran, at least in part, after the request arrived. When deadline
// passes first it returns a LeaseHeldError naming the current holder.
func (l *leaser) wait(ctx context.Context, held leaseValue, deadline time.Time, began time.Time) (*leaseValue, error) {
	tick := time.NewTicker(l.poll)
	defer tick.Stop()
	for {
		cur, _, err := l.get(ctx, l.kv)
		switch {
		case errors.Is(err, bus.ErrKeyNotFound):
			return nil, nil
		case err != nil:
			l.log.Debug("image GC pass lease: read failed while waiting", "err", err)
		case cur.Released:
			return &cur, nil
		default:
			held = cur
		}
		if !time.Now().Before(deadline) {
			return nil, &LeaseHeldError{Node: l.node, Holder: held.Holder, Trigger: held.Trigger, Since: held.Started, Waited: time.Since(began)}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
	}
}

// shareable reports whether a request may be answered with the result of the pass held: a pull-triggered
// request takes any pass run with the node's policy (it measures the room again after); a manual one a pass
// of the same kind (gc or --all-unused) with the node's policy. A request with policy overrides or named
// images runs its own.
func shareable(req events.GCRequest, trigger string, held leaseValue) bool {
	if held.Overrides || hasOverrides(req) {
		return false
	}
	return trigger == events.GCTriggerPull || req.AllUnused == held.AllUnused
}

func hasOverrides(req events.GCRequest) bool {
	return req.HighThresholdPercent != nil || req.LowThresholdPercent != nil || req.MinAge != nil || req.MaxAge != nil ||
		len(req.Images) > 0
}
