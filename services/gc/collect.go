package gc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Kubernetes event reasons of image GC (pkg/kubelet/events), all Warning on the node.
const (
	EventInvalidDiskCapacity = "InvalidDiskCapacity"
	EventFreeDiskSpaceFailed = "FreeDiskSpaceFailed"
	EventImageGCFailed       = "ImageGCFailed"
)

// runtime is the part of the CRI client the GC executor needs.
type runtime interface {
	ListImages(ctx context.Context) ([]cri.Image, error)
	ListContainers(ctx context.Context) ([]cri.Container, error)
	RemoveImage(ctx context.Context, id string) error
	ImageFsInfo(ctx context.Context) ([]cri.FsInfo, error)
}

// collector is one node's image GC: the kubelet's realImageGCManager without its records (the detector
// keeps them) and with removals in bounded parallel batches, each re-checked for use just before.
type collector struct {
	node         string
	capacity     int64
	pinned       *refMatcher
	parallelism  int
	rt           runtime
	records      recordSource
	bus          *bus.Bus
	inUseTimeout time.Duration
	statfs       func(path string) (capacity, available int64, err error)
	now          func() time.Time
	removed      *prometheus.CounterVec
	metrics      *metrics
	// sandboxImage returns the runtime's sandbox image (nil: a runtime that cannot tell).
	sandboxImage func(ctx context.Context) (string, error)
	log          *slog.Logger
}

// pass is one GC pass: its policy and what it did.
type pass struct {
	policy Policy
	// capacity is the byte quota of the node's ImageGCPolicy (0: the collector's, --image-fs-capacity).
	capacity int64
	// pins are the pinned images of the node's ImageGCPolicy objects, each kept with its policy's name.
	pins []policyPins
	// keepLast is the node's ImageGCPolicy keepLastTags (nil: none; not applied to named images).
	keepLast *keepLast
	// keepCopies is the node's ImageGCPolicy keepCopies (nil: none): each removal is granted by the fleet.
	keepCopies *events.GCKeepCopies
	dryRun     bool
	res        events.GCResult
	// meter measures the image filesystem during the space pass (nil: the kubelet's way, declared sizes).
	meter *meter
}

// meter is how a space pass measures what it frees. The kubelet stops freeing once the CRI-declared sizes of
// the removed images add up to amountToFree; on a real disk an image takes more room than its CRI size
// (containerd keeps the compressed content and the unpacked snapshot) or less (layers shared with other
// images), so that stop removes too much or too little. Here the filesystem is measured again after each
// removal batch and the pass stops as soon as the measured available bytes reach the low threshold's.
//
// Batches (each half of what remains) are planned with factor, the estimated disk bytes per declared byte: 1 + the runtime's reported
// image filesystem usage (ImageFsInfo UsedBytes: containerd's snapshots) over the sum of the declared sizes,
// between 1 and maxFactor (1 with a byte quota, or when the runtime reports no usage). A dry run cannot
// measure: it counts each planned image as factor times its declared size, so on an unchanged node it plans
// exactly the batches, and so the images, the real pass removes when the estimate holds.
type meter struct {
	target  int64 // available bytes at the low threshold
	start   int64 // available bytes when the space pass began
	factor  float64
	measure func(ctx context.Context) (int64, error) // nil in a dry run
	avail   int64                                    // available bytes now (measured, or estimated in a dry run)
	log     *slog.Logger
}

// maxFactor bounds the disk-per-declared-byte estimate: a runtime that reports more (a shared filesystem with
// other data) makes batches smaller, never the pass wrong, since the real pass measures.
const maxFactor = 4

// remaining is how many declared bytes are still to free, as the planner counts them.
func (m *meter) remaining() int64 {
	if m.avail >= m.target {
		return 0
	}
	return int64(math.Ceil(float64(m.target-m.avail) / m.factor))
}

// update measures after a batch that freed batchFreed declared bytes (or estimates, in a dry run or when the
// measure fails).
func (m *meter) update(ctx context.Context, batchFreed int64) {
	if m.measure != nil {
		avail, err := m.measure(ctx)
		if err == nil {
			m.avail = avail
			return
		}
		m.log.Warn("measure image filesystem after removals failed, estimating", "err", err)
	}
	m.avail += int64(float64(batchFreed) * m.factor)
}

// garbageCollect is the kubelet's GarbageCollect(ctx, beganGC), with two changes: a failed age pass does
// not skip the space pass (both errors are returned), and in a dry run nothing is removed.
func (c *collector) garbageCollect(ctx context.Context, p *pass, beganGC time.Time) error {
	freeTime := c.now()
	p.res.Started = freeTime
	recs, err := c.records.Detect(ctx, freeTime)
	if err != nil {
		return err
	}
	cands, skipped := c.order(ctx, p, recs)
	p.res.Skipped = append(p.res.Skipped, skipped...)

	before := p.res.FreedBytes
	cands, ageErr := c.freeOldImages(ctx, p, cands, freeTime, beganGC)
	ageFreed := p.res.FreedBytes - before

	capacity, available, fsUsed, err := c.imageFsStats(ctx, p, recs, ageFreed)
	if err != nil {
		return joinErrors(ageErr, err)
	}
	if available > capacity {
		c.log.Info("availability is larger than capacity", "available", available, "capacity", capacity)
		available = capacity
	}
	p.res.CapacityBytes, p.res.AvailableBytes = capacity, available
	if capacity == 0 {
		err := errors.New("invalid capacity 0 on image filesystem")
		c.warn(ctx, p, EventInvalidDiskCapacity, err.Error())
		return joinErrors(ageErr, err)
	}
	usagePercent := 100 - int(available*100/capacity)
	p.res.UsagePercent = usagePercent
	if usagePercent < p.policy.HighThresholdPercent {
		c.notNeeded(p, cands)
		return ageErr
	}
	amountToFree := capacity*int64(100-p.policy.LowThresholdPercent)/100 - available
	p.res.AmountToFree = amountToFree
	c.log.Info("disk usage on image filesystem is over the high threshold, trying to free bytes down to the low threshold",
		"usage", usagePercent, "high_threshold", p.policy.HighThresholdPercent, "amount_to_free", amountToFree,
		"low_threshold", p.policy.LowThresholdPercent, "dry_run", p.dryRun)
	p.meter = c.newMeter(p, capacity, available, fsUsed, recs)
	freed, err := c.freeSpace(ctx, p, amountToFree, freeTime, cands, ReasonSpace)
	if !p.dryRun {
		p.res.MeasuredFreedBytes = p.meter.avail - p.meter.start
		p.res.MeasuredAvailableBytes = p.meter.avail
	}
	if err != nil {
		return joinErrors(ageErr, err)
	}
	if p.meter.avail < p.meter.target {
		msg := fmt.Sprintf("Insufficient free disk space on the node's image filesystem (%d%% of %s used). "+
			"Failed to free sufficient space by deleting unused images (freed %d bytes). "+
			"Investigate disk usage, as it could be used by active images, logs, volumes, or other data.",
			usagePercent, formatSize(capacity), freed)
		c.warn(ctx, p, EventFreeDiskSpaceFailed, msg)
		return joinErrors(ageErr, errors.New(msg))
	}
	return ageErr
}

// order is evictionOrder with the runtime's sandbox (pause) image kept as well: containerd 1.6 does not
// report it pinned, and every pod sandbox runs it, so it is in use whenever a pod runs (the kubelet used to
// exempt its configured --pod-infra-container-image the same way).
func (c *collector) order(ctx context.Context, p *pass, recs map[string]events.ImageRecord) ([]candidate, []events.GCSkipped) {
	cands, skipped := evictionOrder(recs, c.pinned)
	cands, skipped = keepPinnedByPolicies(cands, skipped, p.pins)
	cands, skipped = keepLastTags(cands, skipped, recs, p.keepLast)
	if c.sandboxImage == nil {
		return cands, skipped
	}
	ref, err := c.sandboxImage(ctx)
	if err != nil || ref == "" {
		if err != nil {
			c.log.Debug("runtime sandbox image unknown", "err", err)
		}
		return cands, skipped
	}
	m, _ := newRefMatcher([]string{ref}, false)
	kept := cands[:0]
	for _, cd := range cands {
		if m.match(cd.ImageRecord) {
			skipped = append(skipped, events.GCSkipped{ID: cd.ID, Why: WhySandboxImage})
			continue
		}
		kept = append(kept, cd)
	}
	return kept, skipped
}

// newMeter sets up the space pass's measure (see meter).
func (c *collector) newMeter(p *pass, capacity, available int64, fsUsed uint64, recs map[string]events.ImageRecord) *meter {
	m := &meter{target: capacity * int64(100-p.policy.LowThresholdPercent) / 100, start: available, avail: available,
		factor: 1, log: c.log}
	if c.quota(p) == 0 && fsUsed > 0 {
		var declared int64
		for _, r := range recs {
			declared += r.Size
		}
		if declared > 0 {
			m.factor = min(1+float64(fsUsed)/float64(declared), maxFactor)
		}
	}
	if !p.dryRun {
		m.measure = func(ctx context.Context) (int64, error) { return c.measureAvailable(ctx, c.quota(p)) }
	}
	return m
}

// measureAvailable measures the available bytes of the image filesystem now: statfs of the runtime's image
// filesystem mountpoint, or with a byte quota the quota less the sum of the sizes of the images listed now.
func (c *collector) measureAvailable(ctx context.Context, quota int64) (int64, error) {
	capacity, available, _, err := c.imageFs(ctx, quota)
	if err != nil {
		return 0, err
	}
	return min(available, capacity), nil
}

// quota is the pass's byte quota: its ImageGCPolicy's, else --image-fs-capacity (0: statfs).
func (c *collector) quota(p *pass) int64 {
	if p != nil && p.capacity > 0 {
		return p.capacity
	}
	return c.capacity
}

// imageFs returns the image filesystem's capacity, available bytes and the runtime's reported usage (0
// with a byte quota) now, with quota as the byte quota (0: statfs).
func (c *collector) imageFs(ctx context.Context, quota int64) (capacity, available int64, fsUsed uint64, err error) {
	if quota > 0 {
		imgs, err := c.rt.ListImages(ctx)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("image fs stats: %w", err)
		}
		var used int64
		for _, im := range imgs {
			used += im.Size
		}
		return quota, quota - used, 0, nil
	}
	fs, err := c.rt.ImageFsInfo(ctx)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("image fs stats: %w", err)
	}
	if len(fs) == 0 || fs[0].Mountpoint == "" {
		return 0, 0, 0, errors.New("image fs stats: the runtime reports no image filesystem mountpoint")
	}
	capacity, available, err = c.statfs(fs[0].Mountpoint)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("image fs stats: %w", err)
	}
	return capacity, available, fs[0].UsedBytes, nil
}

// deleteUnusedImages is the kubelet's DeleteUnusedImages: every eligible image (MinAge still honoured).
func (c *collector) deleteUnusedImages(ctx context.Context, p *pass) error {
	c.log.Info("attempting to delete unused images", "dry_run", p.dryRun)
	freeTime := c.now()
	p.res.Started = freeTime
	p.res.AllUnused = true
	recs, err := c.records.Detect(ctx, freeTime)
	if err != nil {
		return err
	}
	cands, skipped := c.order(ctx, p, recs)
	p.res.Skipped = append(p.res.Skipped, skipped...)
	// What is reported: the image filesystem and the eligible bytes (the kubelet passes MaxInt64 as the
	// amount to free, and it still does here: every eligible image goes). With a byte quota the usage is
	// the sum of the records just detected, as in garbageCollect, not a second listing of the runtime.
	var eligible int64
	for _, cd := range cands {
		if cd.LastUsed.Before(freeTime) && freeTime.Sub(cd.FirstDetected) >= p.policy.MinAge {
			eligible += cd.Size
		}
	}
	p.res.AmountToFree = eligible
	if capacity, available, _, err := c.imageFsStats(ctx, p, recs, 0); err == nil && capacity > 0 {
		available = min(available, capacity)
		p.res.CapacityBytes, p.res.AvailableBytes = capacity, available
		p.res.UsagePercent = 100 - int(available*100/capacity)
	} else if err != nil {
		c.log.Warn("image fs stats for the report failed", "err", err)
	}
	_, err = c.freeSpace(ctx, p, math.MaxInt64, freeTime, cands, ReasonUnused)
	if !p.dryRun && p.res.CapacityBytes > 0 {
		if avail, mErr := c.measureAvailable(ctx, c.quota(p)); mErr == nil {
			p.res.MeasuredAvailableBytes = avail
			p.res.MeasuredFreedBytes = avail - p.res.AvailableBytes
		}
	}
	return err
}

// deleteNamedImages removes every unused image one of patterns names, whatever the usage and the minimum
// age (Eraser's ImageList): the fleet's way to remove one image everywhere it is not in use. In-use and
// pinned images that match are reported as skipped; images that do not match are not reported.
func (c *collector) deleteNamedImages(ctx context.Context, p *pass, patterns []string) error {
	m, err := newRefMatcher(patterns, true)
	if err != nil {
		return fmt.Errorf("gc request images: %w", err)
	}
	c.log.Info("attempting to delete named images", "dry_run", p.dryRun, "images", len(patterns))
	p.keepLast = nil // an image named for removal goes even if it is one of its repository's last tags
	freeTime := c.now()
	p.res.Started = freeTime
	recs, err := c.records.Detect(ctx, freeTime)
	if err != nil {
		return err
	}
	cands, skipped := c.order(ctx, p, recs)
	for _, s := range skipped {
		if r, ok := recs[s.ID]; ok && m.match(r) {
			p.res.Skipped = append(p.res.Skipped, s)
		}
	}
	var named []candidate
	for _, cd := range cands {
		if m.match(cd.ImageRecord) {
			named = append(named, cd)
			p.res.AmountToFree += cd.Size
		}
	}
	p.policy.MinAge = 0 // named: removed however young
	_, err = c.freeSpace(ctx, p, math.MaxInt64, freeTime, named, ReasonNamed)
	return err
}

// freeOldImages is the kubelet's MaxAge pass with two fixes (W-B): age is measured from
// max(lastUsed, firstDetected), so an image pulled but not yet used is as young as its detection, and an
// image younger than MinAge is kept. Like the kubelet, nothing happens until MaxAge has passed since beganGC.
// It returns the candidates left for the space pass.
func (c *collector) freeOldImages(ctx context.Context, p *pass, cands []candidate, freeTime, beganGC time.Time) ([]candidate, error) {
	maxAge := p.policy.MaxAge
	if maxAge == 0 || freeTime.Sub(beganGC) <= maxAge {
		return cands, nil
	}
	var old []candidate
	for _, cd := range cands {
		last := cd.LastUsed
		if cd.FirstDetected.After(last) {
			last = cd.FirstDetected
		}
		if freeTime.Sub(last) > maxAge && freeTime.Sub(cd.FirstDetected) >= p.policy.MinAge {
			old = append(old, cd)
		}
	}
	if len(old) == 0 {
		return cands, nil
	}
	gone := make(map[string]bool, len(old))
	var errs []error
	for start := 0; start < len(old); start += c.batchSize() {
		batch := old[start:min(start+c.batchSize(), len(old))]
		for _, o := range c.removeBatch(ctx, p, batch, ReasonAge) {
			switch {
			case o.inUse, o.kept != "":
				gone[o.c.ID] = true // in use or kept by keepCopies: not a candidate of the space pass either
			case o.err != nil:
				errs = append(errs, o.err) // kept, as the kubelet keeps it
			default:
				gone[o.c.ID] = true
			}
		}
	}
	remaining := make([]candidate, 0, len(cands)-len(gone))
	for _, cd := range cands {
		if !gone[cd.ID] {
			remaining = append(remaining, cd)
		}
	}
	if len(errs) > 0 {
		return remaining, fmt.Errorf("wanted to free images older than %v, encountered errors in image deletion: %v", maxAge, aggregate(errs))
	}
	return remaining, nil
}

// freeSpace is the kubelet's freeSpace: candidates in eviction order, skipping those used at or after
// freeTime and those younger than MinAge; a failed removal does not stop the pass; it stops once a removal
// succeeded and freed >= bytesToFree. Here the removals the kubelet would make one by one are planned
// ahead and made in batches of up to RemovalParallelism at once: each batch is the prefix of the remaining
// eligible candidates that would bring freed to bytesToFree if every removal succeeded; when some fail, the
// next batch continues with the next candidates. If every removal succeeds, the images removed are exactly
// the kubelet's.
//
// With p.meter (the space pass of GarbageCollect), the stop and the batches follow the measured filesystem
// instead (see meter): each batch covers half of what remains by the meter's estimate, the filesystem is
// measured after it, and the pass stops once the measure reaches the low threshold's available bytes. With a
// faithful measure (the disk gives back the declared sizes), the images removed are still the kubelet's.
func (c *collector) freeSpace(ctx context.Context, p *pass, bytesToFree int64, freeTime time.Time, cands []candidate, reason string) (int64, error) {
	var (
		freed      int64
		removedAny bool
		errs       []error
		i          int
	)
	m := p.meter
	// As the kubelet, the stop is checked only after a removal: a pass that starts over the high threshold
	// with nothing to free by its rounded target (usage and the target's bytes are both rounded down) still
	// removes the first eligible image, or every usage check would start a pass that removes nothing.
	enough := func() bool {
		if m != nil {
			return removedAny && m.avail >= m.target
		}
		return removedAny && freed >= bytesToFree
	}
	for i < len(cands) && !enough() && ctx.Err() == nil {
		var batch []candidate
		planned, toPlan := freed, bytesToFree
		if m != nil {
			// Half of what remains at a time (at least one image): when the estimate is short of the disk's
			// real figure, the measure after a step stops the pass before it removes much more than needed.
			// The images a dry run lists do not change with the step size: the pass ends at the first image
			// whose estimate reaches the target either way.
			planned, toPlan = 0, (m.remaining()+1)/2
		}
		for i < len(cands) && len(batch) < c.batchSize() && (len(batch) == 0 || planned < toPlan) {
			cd := cands[i]
			i++
			if !cd.LastUsed.Before(freeTime) {
				p.res.Skipped = append(p.res.Skipped, events.GCSkipped{ID: cd.ID, Why: WhyInUse})
				continue
			}
			if freeTime.Sub(cd.FirstDetected) < p.policy.MinAge {
				p.res.Skipped = append(p.res.Skipped, events.GCSkipped{ID: cd.ID, Why: WhyTooYoung})
				continue
			}
			batch = append(batch, cd)
			planned += cd.Size
		}
		if len(batch) == 0 {
			break
		}
		var batchFreed int64
		for _, o := range c.removeBatch(ctx, p, batch, reason) {
			switch {
			case o.inUse, o.kept != "":
			case o.err != nil:
				errs = append(errs, o.err)
			default:
				batchFreed += o.c.Size
				removedAny = true
			}
		}
		freed += batchFreed
		if m != nil {
			m.update(ctx, batchFreed)
		}
	}
	c.notNeeded(p, cands[i:])
	if len(errs) > 0 {
		return freed, fmt.Errorf("wanted to free %d bytes, but freed %d bytes space with errors in image deletion: %w", bytesToFree, freed, aggregate(errs))
	}
	return freed, nil
}

// batchSize is how many removals share one in-use re-check. They run through a pool of RemovalParallelism
// without a barrier between pool-widths (a barrier per width made every width wait for its slowest removal:
// 1.1x the serial rate at 4 and 2.1-2.6x at 16 against containerd's 4x), and the re-check stays fresh: one
// batch of 64 small images takes about 60 ms on containerd.
func (c *collector) batchSize() int { return 4 * c.parallelism }

func (c *collector) notNeeded(p *pass, cands []candidate) {
	for _, cd := range cands {
		p.res.Skipped = append(p.res.Skipped, events.GCSkipped{ID: cd.ID, Why: WhyNotNeeded})
	}
}

// outcome is what happened to one image of a removal batch.
type outcome struct {
	c     candidate
	inUse bool   // found in use by the re-check: not removed
	kept  string // kept by keepCopies, and why: not removed
	err   error  // removal failed
	// granted: the fleet's copies arbiter recorded this removal (keepCopies), so a failed one gives it back.
	granted bool
}

// removeBatch re-checks that the batch is unused (containers listed by the runtime now, and the pod index's
// image references), then, under keepCopies, asks the fleet which of the rest may go (grantCopies), then
// removes those at once, and gives the fleet back the grants of those whose removal failed (releaseCopies).
// "Already gone" counts as removed. Results are recorded
// in p in batch order; image.removed events are published.
func (c *collector) removeBatch(ctx context.Context, p *pass, batch []candidate, reason string) []outcome {
	out := make([]outcome, len(batch))
	for i := range batch {
		out[i].c = batch[i]
	}
	inUse, err := c.inUseNow(ctx)
	if err != nil {
		for i := range out {
			out[i].err = fmt.Errorf("re-check image %q in use before removal: %w", out[i].c.ID, err)
		}
	} else {
		for i := range out {
			out[i].inUse = inUse(out[i].c.ImageRecord)
		}
		c.grantCopies(ctx, p, out)
		var wg sync.WaitGroup
		sem := make(chan struct{}, c.parallelism)
		for i := range out {
			if out[i].inUse || out[i].kept != "" {
				continue
			}
			if p.dryRun {
				continue
			}
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				out[i].err = c.removeImage(ctx, out[i].c, reason)
			}()
		}
		wg.Wait()
		c.releaseCopies(ctx, p, out)
	}
	var evs []events.Event
	for _, o := range out {
		switch {
		case o.inUse:
			c.log.Info("image in use at removal time, kept", "image_id", o.c.ID)
			p.res.Skipped = append(p.res.Skipped, events.GCSkipped{ID: o.c.ID, Why: WhyInUseAtRemoval})
		case o.kept != "":
			p.res.Skipped = append(p.res.Skipped, events.GCSkipped{ID: o.c.ID, Why: o.kept, Policy: p.keepCopies.Policy})
		case o.err != nil:
			p.res.Removed = append(p.res.Removed, events.GCRemoved{ID: o.c.ID, RepoTags: o.c.RepoTags, Size: o.c.Size, Reason: reason, Error: o.err.Error()})
		default:
			p.res.Removed = append(p.res.Removed, events.GCRemoved{ID: o.c.ID, RepoTags: o.c.RepoTags, Size: o.c.Size, Reason: reason})
			p.res.FreedBytes += o.c.Size
			if p.dryRun {
				continue
			}
			c.removed.WithLabelValues(metricReason(reason)).Inc()
			ev, err := events.New(c.node, events.EntityImage, events.ActionRemoved,
				events.ImageRemoved{ID: o.c.ID, RepoTags: o.c.RepoTags, Size: o.c.Size, Reason: reason})
			if err == nil {
				evs = append(evs, ev)
			}
		}
	}
	c.publish(ctx, evs...)
	return out
}

func (c *collector) removeImage(ctx context.Context, cd candidate, reason string) error {
	c.log.Info("removing image to free bytes", "image_id", cd.ID, "size", cd.Size, "reason", reason)
	err := c.rt.RemoveImage(ctx, cd.ID)
	if errors.Is(err, cri.ErrNotFound) {
		c.log.Info("image already gone", "image_id", cd.ID)
		return nil
	}
	return err
}

// inUseNow returns whether an image is in use right now: the image ID of a container the runtime lists
// (running or exited), the image reference a container was created from, or a reference named by a pod in
// the pod index (a pod whose container does not exist yet: kubernetes/kubernetes#123631, #18140).
func (c *collector) inUseNow(ctx context.Context) (func(events.ImageRecord) bool, error) {
	containers, err := c.rt.ListContainers(ctx)
	if err != nil {
		return nil, err
	}
	ids := make(map[string]bool, len(containers))
	var refs []string
	for _, ct := range containers {
		ids[ct.ImageID] = true
		if ct.Image != "" {
			refs = append(refs, ct.Image)
		}
	}
	podRefs, err := c.podIndexImages(ctx)
	if err != nil {
		return nil, err
	}
	m, _ := newRefMatcher(append(refs, podRefs...), false)
	return func(r events.ImageRecord) bool { return ids[r.ID] || m.match(r) }, nil
}

// podIndexImages asks the pod index for the image references of the node's pods. No pod index running
// (no responders) means no such references: the check is skipped.
func (c *collector) podIndexImages(ctx context.Context) ([]string, error) {
	if c.bus == nil {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.inUseTimeout)
	defer cancel()
	var rep events.InUseReply
	err := c.bus.Request(ctx, events.QuerySubject(c.node, events.QryInUse), nil, &rep)
	if errors.Is(err, bus.ErrNoResponders) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("ask the pod index: %w", err)
	}
	return rep.Images, nil
}

// imageFsStats returns the capacity and available bytes of the image filesystem: from the byte quota
// (used = the sum of the image sizes, less what the age pass removed), or statfs of the runtime's image
// filesystem mountpoint. In a dry run, what the age pass would have removed is counted as available.
func (c *collector) imageFsStats(ctx context.Context, p *pass, recs map[string]events.ImageRecord, ageFreed int64) (capacity, available int64, fsUsed uint64, err error) {
	if q := c.quota(p); q > 0 {
		var used int64
		for _, r := range recs {
			used += r.Size
		}
		return q, q - (used - ageFreed), 0, nil
	}
	capacity, available, fsUsed, err = c.imageFs(ctx, 0)
	if err != nil {
		return 0, 0, 0, err
	}
	if p.dryRun {
		available += ageFreed
	}
	return capacity, available, fsUsed, nil
}

// warn publishes a Kubernetes Warning event on the node (not in a dry run).
func (c *collector) warn(ctx context.Context, p *pass, reason, message string) {
	if p != nil && p.dryRun {
		return
	}
	ev, err := events.New(c.node, events.EntityNode, events.ActionWarning, events.NodeWarning{Reason: reason, Message: message})
	if err != nil {
		return
	}
	c.publish(ctx, ev.WithKube(events.Warning, reason, message, &events.ObjectRef{Kind: "Node", Name: c.node}))
}

// publish publishes events; a failure is logged, not returned: what GC did stays done.
func (c *collector) publish(ctx context.Context, evs ...events.Event) {
	if len(evs) == 0 || c.bus == nil {
		return
	}
	if err := c.bus.PublishAll(ctx, evs); err != nil {
		c.log.Warn("publish events failed", "err", err, "events", len(evs))
	}
}

// joinErrors reports both the age pass's and the space pass's errors.
func joinErrors(first, second error) error {
	switch {
	case first == nil:
		return second
	case second == nil:
		return first
	}
	return fmt.Errorf("%w; %w", first, second)
}

// formatSize is the kubelet's formatSize: B, KiB, MiB, GiB, TiB with one decimal.
func formatSize(sizeBytes int64) string {
	const (
		KiB = 1024
		MiB = 1024 * KiB
		GiB = 1024 * MiB
		TiB = 1024 * GiB
	)
	size := float64(sizeBytes)
	switch {
	case size < KiB:
		return fmt.Sprintf("%d B", int64(size))
	case size < MiB:
		return fmt.Sprintf("%.1f KiB", size/KiB)
	case size < GiB:
		return fmt.Sprintf("%.1f MiB", size/MiB)
	case size < TiB:
		return fmt.Sprintf("%.1f GiB", size/GiB)
	default:
		return fmt.Sprintf("%.1f TiB", size/TiB)
	}
}
