package kubeletdiff

import (
	"context"
	"errors"
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"log/slog"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	noopoteltrace "go.opentelemetry.io/otel/trace/noop"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	containertest "k8s.io/kubernetes/pkg/kubelet/container/testing"
	"k8s.io/kubernetes/pkg/kubelet/images"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/gc/gctest"
)

// The named, intended differences of imagefleet's image GC from the kubelet's (docs/kubelet-diff.md). A case
// whose outcome depends on one of them is not compared in full; the test counts each and shows the counts.
const (
	// diffAgeFromDetection is weakness W-B: the kubelet's age pass (imageMaximumGCAge) measures age from
	// lastUsed alone, so an image never used is "older" than any MaxAge the moment it is detected, and it
	// ignores imageMinimumGCAge; imagefleet measures age from max(lastUsed, firstDetected) and keeps images
	// younger than MinAge. A case where the two rules disagree on some candidate is excluded.
	diffAgeFromDetection = "age measured from max(lastUsed, firstDetected), MinAge honoured (W-B)"
	// diffAgeErrorContinues: when a removal of the age pass fails, the kubelet returns at once and skips the
	// space pass; imagefleet still runs the space pass and reports both errors. Only the age pass is compared.
	diffAgeErrorContinues = "a failed age-pass removal does not skip the space pass"
)

// gcCases is how many seeded cases TestImageGCMatchesKubelet runs (KUBELETDIFF_GC_CASES overrides).
const gcCases = 5000

// t0 is the start of a synctest bubble: the kubelet's time.Now() inside it.
var t0 = time.Date(2000, time.January, 1, 0, 0, 0, 0, time.UTC)

type gcImage struct {
	id     string
	size   int64
	pinned bool
	fail   string // RemoveImage fails with this text ("" succeeds)
}

// gcStep is one detection: the time since the previous step and, per image, whether the runtime lists it
// and whether a container uses it.
type gcStep struct {
	after   time.Duration
	present []bool
	used    []bool
}

type gcCase struct {
	seed      uint64
	images    []gcImage
	steps     []gcStep // the last one is the GC pass's own detection (its freeTime)
	beganGC   time.Duration
	capacity  int64
	other     int64 // bytes of the image filesystem used by other files (negative: available > capacity)
	policy    images.ImageGCPolicy
	allUnused bool
	parallel  int
}

func (c *gcCase) at(step int) time.Time {
	t := t0
	for i := 0; i <= step; i++ {
		t = t.Add(c.steps[i].after)
	}
	return t
}

func (c *gcCase) freeTime() time.Time { return c.at(len(c.steps) - 1) }

// record is what the kubelet's detectImages keeps of image i at the pass, by definition: firstDetected is
// the first step of the image's last unbroken run of listings, lastUsed the last step of that run where a
// container used it (zero if none).
func (c *gcCase) record(i int) (firstDetected, lastUsed time.Time) {
	last := len(c.steps) - 1
	start := last
	for start > 0 && c.steps[start-1].present[i] {
		start--
	}
	firstDetected = c.at(start)
	for s := start; s <= last; s++ {
		if c.steps[s].used[i] {
			lastUsed = c.at(s)
		}
	}
	return firstDetected, lastUsed
}

func (c *gcCase) candidate(i int) bool {
	last := c.steps[len(c.steps)-1]
	return last.present[i] && !last.used[i] && !c.images[i].pinned
}

// tieKey is the kubelet's eviction order key: images with equal keys may be removed in any order.
func (c *gcCase) tieKey(id string) string {
	for i, im := range c.images {
		if im.id == id {
			fd, lu := c.record(i)
			return lu.Format(time.RFC3339Nano) + "|" + fd.Format(time.RFC3339Nano)
		}
	}
	return "?" + id
}

func (c *gcCase) size(id string) int64 {
	for _, im := range c.images {
		if im.id == id {
			return im.size
		}
	}
	return 0
}

// excluded names the intended difference this case's outcome depends on ("" when none).
func (c *gcCase) excluded() string {
	if c.allUnused || c.policy.MaxAge == 0 || c.freeTime().Sub(t0.Add(c.beganGC)) <= c.policy.MaxAge {
		return ""
	}
	free := c.freeTime()
	for i := range c.images {
		if !c.candidate(i) {
			continue
		}
		fd, lu := c.record(i)
		kubeOld := free.Sub(lu) > c.policy.MaxAge
		last := lu
		if fd.After(last) {
			last = fd
		}
		ourOld := free.Sub(last) > c.policy.MaxAge && free.Sub(fd) >= c.policy.MinAge
		if kubeOld != ourOld {
			return diffAgeFromDetection
		}
	}
	return ""
}

func (c *gcCase) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d: policy %+v allUnused=%v beganGC=+%v capacity=%d other=%d parallelism=%d\n",
		c.seed, c.policy, c.allUnused, c.beganGC, c.capacity, c.other, c.parallel)
	for i, im := range c.images {
		fd, lu := c.record(i)
		fmt.Fprintf(&b, "  %s size=%d pinned=%v fail=%q firstDetected=+%v lastUsed=%v candidate=%v\n",
			im.id, im.size, im.pinned, im.fail, fd.Sub(t0), lu.Format(time.TimeOnly+".000000000"), c.candidate(i))
	}
	for s, st := range c.steps {
		fmt.Fprintf(&b, "  step %d +%v present=%v used=%v\n", s, c.at(s).Sub(t0), st.present, st.used)
	}
	return b.String()
}

var gcDurations = []time.Duration{0, time.Nanosecond, time.Second, 59 * time.Second, time.Minute, 2 * time.Minute, 3 * time.Minute, 5 * time.Minute, 10 * time.Minute}

func pick[T any](r *rand.Rand, xs ...T) T { return xs[r.IntN(len(xs))] }

// newGCCase draws a case. Sizes, ages and thresholds come from small sets so that ties (equal times, equal
// sizes) and exact boundaries (age == MinAge, freed == amountToFree) are common.
func newGCCase(seed uint64) *gcCase {
	r := rand.New(rand.NewPCG(seed, 0x6b7562656c6574))
	c := &gcCase{seed: seed, parallel: pick(r, 1, 2, 16)}
	n := 1 + r.IntN(10)
	unit := pick[int64](r, 1, 1000, 1<<20, 1<<30, 1<<40/100)
	seen := map[string]bool{}
	for len(c.images) < n {
		id := fmt.Sprintf("sha256:%08x", r.Uint32()&0xfff)
		if seen[id] {
			continue
		}
		seen[id] = true
		im := gcImage{id: id, size: unit * int64(pick(r, 1, 1, 2, 3, 5, 8, 10, 20)), pinned: r.IntN(10) == 0}
		if r.IntN(12) == 0 {
			im.fail = pick(r, "rpc error: code = Unknown desc = image is in use by a container (conflict)",
				"rpc error: code = Unavailable desc = read-only file system")
		}
		c.images = append(c.images, im)
	}
	steps := 1 + r.IntN(5)
	for s := range steps {
		st := gcStep{after: pick(r, gcDurations...), present: make([]bool, n), used: make([]bool, n)}
		if s == 0 {
			st.after = 0
		}
		for i := range n {
			switch {
			case s == 0:
				st.present[i] = r.IntN(4) != 0
			case c.steps[s-1].present[i]:
				st.present[i] = r.IntN(12) != 0
			default:
				st.present[i] = r.IntN(3) == 0
			}
			if s == steps-1 && r.IntN(5) != 0 {
				st.present[i] = true // most images are there at the pass
			}
			st.used[i] = st.present[i] && r.IntN(3) == 0
		}
		c.steps = append(c.steps, st)
	}
	var sum int64
	for i, im := range c.images {
		if c.steps[steps-1].present[i] {
			sum += im.size
		}
	}
	switch r.IntN(40) {
	case 0:
		c.capacity = 0 // InvalidDiskCapacity
	case 1:
		c.capacity = sum + unit
		c.other = -2 * sum // available > capacity
	default:
		c.capacity = sum + unit*int64(r.IntN(30))
		c.other = unit * int64(r.IntN(10))
		if c.other > c.capacity-sum {
			c.other = c.capacity - sum
		}
	}
	c.policy.HighThresholdPercent = r.IntN(101)
	c.policy.LowThresholdPercent = r.IntN(c.policy.HighThresholdPercent + 1)
	c.policy.MinAge = pick(r, 0, 0, time.Nanosecond, time.Second, time.Minute, 2*time.Minute, 5*time.Minute)
	if r.IntN(3) == 0 {
		c.policy.MaxAge = pick(r, time.Nanosecond, time.Second, time.Minute, 2*time.Minute, 5*time.Minute, 10*time.Minute)
	}
	c.beganGC = c.freeTime().Sub(t0) - pick(r, 0, time.Second, time.Minute, 3*time.Minute, 10*time.Minute, time.Hour)
	if c.beganGC < 0 {
		c.beganGC = 0
	}
	c.allUnused = r.IntN(5) == 0
	return c
}

// available is the image filesystem's free bytes with the listed images on it.
func (c *gcCase) available(listed []string) int64 {
	used := c.other
	for _, id := range listed {
		used += c.size(id)
	}
	return max(c.capacity-used, 0)
}

// attempt is one RemoveImage call.
type attempt struct {
	id, reason string
	ok         bool
}

// gcOutcome is what one GC pass did.
type gcOutcome struct {
	attempts []attempt
	err      string
	freed    int64 // imagefleet's FreedBytes (the kubelet returns none: its removals' sizes)
}

func (o gcOutcome) String() string {
	var b strings.Builder
	for _, a := range o.attempts {
		fmt.Fprintf(&b, "  %s %s ok=%v\n", a.reason, a.id, a.ok)
	}
	fmt.Fprintf(&b, "  err: %s\n", o.err)
	return b.String()
}

// kubeRuntime is the kubelet's fake runtime with removals that fail per image and a call log.
type kubeRuntime struct {
	*containertest.FakeRuntime
	c     *gcCase
	phase *string
	log   []attempt
}

func (r *kubeRuntime) RemoveImage(ctx context.Context, image kubecontainer.ImageSpec) error {
	for _, im := range r.c.images {
		if im.id == image.Image && im.fail != "" {
			r.log = append(r.log, attempt{id: image.Image, reason: *r.phase})
			return errors.New(im.fail)
		}
	}
	r.log = append(r.log, attempt{id: image.Image, reason: *r.phase, ok: true})
	return r.FakeRuntime.RemoveImage(ctx, image)
}

// kubeStats is the image filesystem under the kubelet's fake runtime: capacity, and available = capacity -
// other files - the listed images. It marks the end of the age pass (the kubelet reads the stats after it).
type kubeStats struct {
	rt    *kubeRuntime
	fail  bool
	phase *string
}

var errStatsOff = errors.New("stats switched off for a detection-only pass")

func (s *kubeStats) ImageFsStats(context.Context) (*statsapi.FsStats, *statsapi.FsStats, error) {
	if s.fail {
		return nil, nil, errStatsOff
	}
	*s.phase = gc.ReasonSpace
	s.rt.Lock()
	var listed []string
	for _, im := range s.rt.ImageList {
		listed = append(listed, im.ID)
	}
	s.rt.Unlock()
	capacity, available := uint64(s.rt.c.capacity), uint64(s.rt.c.available(listed))
	fs := &statsapi.FsStats{CapacityBytes: &capacity, AvailableBytes: &available}
	return fs, fs, nil
}

// runKubelet runs the case through the kubelet's realImageGCManager inside a synctest bubble, where its
// time.Now() is the bubble's fake clock: each step sleeps its duration, then detects (a GarbageCollect whose
// stats fail right after detection, with beganGC = now so the age pass does nothing), and the last step is
// the pass itself.
func runKubelet(t *testing.T, c *gcCase) (out gcOutcome) {
	synctest.Test(t, func(t *testing.T) {
		if !time.Now().Equal(t0) {
			t.Fatalf("synctest bubble starts at %v, want %v", time.Now(), t0)
		}
		ctx := klog.NewContext(t.Context(), logr.Discard())
		phase := gc.ReasonAge
		rt := &kubeRuntime{FakeRuntime: &containertest.FakeRuntime{}, c: c, phase: &phase}
		stats := &kubeStats{rt: rt, phase: &phase}
		recorder := record.NewFakeRecorder(100)
		m, err := images.NewImageGCManager(rt, stats, nil, recorder, &v1.ObjectReference{Kind: "Node", Name: "node-1"}, c.policy, noopoteltrace.NewTracerProvider())
		if err != nil {
			t.Fatal(err)
		}
		for s, st := range c.steps {
			time.Sleep(st.after)
			rt.Lock()
			rt.ImageList, rt.AllPodList = nil, nil
			pod := &kubecontainer.Pod{ID: "pod", Name: "pod", Namespace: "ns"}
			for i, im := range c.images {
				if st.present[i] {
					rt.ImageList = append(rt.ImageList, kubecontainer.Image{ID: im.id, Size: im.size, Pinned: im.pinned})
				}
				if st.used[i] {
					pod.Containers = append(pod.Containers, &kubecontainer.Container{ID: kubecontainer.ContainerID{Type: "test", ID: fmt.Sprint("c", i)}, ImageID: im.id})
				}
			}
			rt.AllPodList = []*containertest.FakePod{{Pod: pod}}
			rt.Unlock()
			if s < len(c.steps)-1 {
				stats.fail = true
				if err := m.GarbageCollect(ctx, time.Now()); !errors.Is(err, errStatsOff) {
					t.Fatalf("detection-only pass: %v", err)
				}
				continue
			}
			stats.fail = false
			if c.allUnused {
				phase = gc.ReasonUnused
				err = m.DeleteUnusedImages(ctx)
			} else {
				err = m.GarbageCollect(ctx, t0.Add(c.beganGC))
			}
		}
		out.attempts = rt.log
		if err != nil {
			out.err = err.Error()
		}
		for len(recorder.Events) > 0 {
			ev := <-recorder.Events
			if !strings.HasPrefix(ev, "Warning ") || !strings.Contains(out.err, strings.SplitN(ev, " ", 3)[2]) {
				t.Errorf("kubelet event %q is not in its error %q", ev, out.err)
			}
		}
	})
	return out
}

// imagefleetGC runs the case through imagefleet's GC executor (gc.New, Service.GarbageCollect) over its fake
// runtime and the detector's own detection (gctest.Records runs detector.Detect), with a real embedded NATS.
// It returns a dry run made first and the real pass.
func imagefleetGC(t *testing.T, b *bus.Bus, c *gcCase) (dry, real gcOutcome) {
	ctx := t.Context()
	rt := critest.NewRuntime()
	clock := critest.NewClock(t0)
	recs := gctest.NewRecords(rt, clock.Now)
	for i, im := range c.images {
		if im.fail != "" {
			rt.FailRemove(c.images[i].id, errors.New(im.fail))
		}
	}
	setStep := func(st gcStep) {
		var ims []cri.Image
		var cs []cri.Container
		for i, im := range c.images {
			if st.present[i] {
				ims = append(ims, cri.Image{ID: im.id, Size: im.size, Pinned: im.pinned})
			}
			if st.used[i] {
				cs = append(cs, cri.Container{ID: fmt.Sprint("c", i), ImageID: im.id, State: cri.ContainerRunning})
			}
		}
		rt.SetImages(ims...)
		rt.SetContainers(cs...)
	}
	for s, st := range c.steps[:len(c.steps)-1] {
		clock.Set(c.at(s))
		setStep(st)
		if _, err := recs.Detect(ctx, c.at(s)); err != nil {
			t.Fatal(err)
		}
	}
	setStep(c.steps[len(c.steps)-1])
	clock.Set(t0.Add(c.beganGC)) // New captures beganGC from the clock
	s, err := gc.New(gc.Config{
		Node: "node-1", Policy: gc.DefaultPolicy(), RemovalParallelism: c.parallel,
		Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler),
	}, gc.Deps{
		Runtime: rt, Bus: b, Records: recs, Now: clock.Now,
		Statfs: func(string) (int64, int64, error) { return c.capacity, c.available(rt.Images()), nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	clock.Set(c.freeTime())
	high, low := c.policy.HighThresholdPercent, c.policy.LowThresholdPercent
	req := events.GCRequest{
		AllUnused: c.allUnused, HighThresholdPercent: &high, LowThresholdPercent: &low,
		MinAge: &events.Duration{Duration: c.policy.MinAge}, MaxAge: &events.Duration{Duration: c.policy.MaxAge},
	}
	run := func(dryRun bool) gcOutcome {
		req.DryRun = dryRun
		res, err := s.GarbageCollect(ctx, req)
		var o gcOutcome
		if err != nil {
			o.err = err.Error()
			if res.Error != o.err {
				t.Errorf("result error %q, returned error %q", res.Error, o.err)
			}
		}
		var sum int64
		for _, r := range res.Removed {
			o.attempts = append(o.attempts, attempt{id: r.ID, reason: r.Reason, ok: r.Error == ""})
			if r.Error == "" {
				sum += c.size(r.ID)
			}
		}
		o.freed = res.FreedBytes
		if o.freed != sum {
			t.Errorf("FreedBytes %d, but the removed images' sizes add up to %d (dry run %v)", o.freed, sum, dryRun)
		}
		return o
	}
	dry = run(true)
	real = run(false)
	return dry, real
}

// group is a run of attempts of one reason whose images tie in the kubelet's order.
type group struct {
	reason, key string
	ids         []string // in attempt order
	ok          map[string]bool
}

func groups(c *gcCase, as []attempt) []group {
	var out []group
	for _, a := range as {
		key := c.tieKey(a.id)
		if n := len(out); n == 0 || out[n-1].reason != a.reason || out[n-1].key != key {
			out = append(out, group{reason: a.reason, key: key, ok: map[string]bool{}})
		}
		g := &out[len(out)-1]
		g.ids = append(g.ids, a.id)
		g.ok[a.id] = a.ok
	}
	return out
}

func sameSet(a, b group) bool {
	if len(a.ok) != len(b.ok) {
		return false
	}
	for id, ok := range a.ok {
		if bok, found := b.ok[id]; !found || bok != ok {
			return false
		}
	}
	return true
}

var (
	freedInError = regexp.MustCompile(`but freed \d+ bytes space`)
	aggregated   = regexp.MustCompile(`\[([^\[\]]*)\]`)
)

// canonicalError sorts the errors of an aggregate (their order follows the eviction order, whose ties the
// kubelet breaks at random) and, with anyFreed, hides the freed byte count.
func canonicalError(s string, anyFreed bool) string {
	if anyFreed {
		s = freedInError.ReplaceAllString(s, "but freed N bytes space")
	}
	return aggregated.ReplaceAllStringFunc(s, func(m string) string {
		parts := strings.Split(m[1:len(m)-1], ", ")
		slices.Sort(parts)
		return "[" + strings.Join(parts, ", ") + "]"
	})
}

// compareGC compares the kubelet's and imagefleet's passes: the same removals (image and reason) in the
// same order of tie groups, each group as a set; the last group of a pass that stopped on reaching its target
// may hold different images of the group when the kubelet broke the tie otherwise, and then imagefleet's
// must be in ID order and stop at the kubelet's rule. The error texts must be equal up to the order of
// aggregated errors.
func compareGC(c *gcCase, kube, ours gcOutcome) error {
	kg, og := groups(c, kube.attempts), groups(c, ours.attempts)
	for _, g := range og {
		if !slices.IsSorted(g.ids) {
			return fmt.Errorf("imagefleet removed tied images %v out of ID order", g.ids)
		}
	}
	cut := false
	if len(kg) != len(og) {
		return fmt.Errorf("removal groups differ: kubelet %d, imagefleet %d", len(kg), len(og))
	}
	for i := range kg {
		if kg[i].reason != og[i].reason || kg[i].key != og[i].key {
			return fmt.Errorf("removal group %d differs: kubelet %s %s, imagefleet %s %s", i, kg[i].reason, kg[i].key, og[i].reason, og[i].key)
		}
		if sameSet(kg[i], og[i]) {
			continue
		}
		if i != len(kg)-1 || kg[i].reason != gc.ReasonSpace {
			return fmt.Errorf("removal group %d (%s) differs: kubelet %v, imagefleet %v", i, kg[i].reason, kg[i].ok, og[i].ok)
		}
		// The last group of the space pass, cut by the target: both must have stopped on reaching it.
		cut = true
		kf, of := freedBytes(c, kube.attempts), freedBytes(c, ours.attempts)
		target := amountToFree(c, kube.attempts)
		for side, f := range map[string][2]int64{"kubelet": kf, "imagefleet": of} {
			if f[0] < target || f[0]-f[1] >= target {
				return fmt.Errorf("%s freed %d bytes (last removal %d) for a target of %d: not the first point at or past it", side, f[0], f[1], target)
			}
		}
	}
	if !cut {
		if ke, oe := canonicalError(kube.err, false), canonicalError(ours.err, false); ke != oe {
			return fmt.Errorf("errors differ:\nkubelet:    %s\nimagefleet: %s", kube.err, ours.err)
		}
		return nil
	}
	// Cut inside a tie group: which of the group's images each tried, and so which failed, follows its tie
	// order. Each side's error must then say exactly what its own removals did.
	for side, o := range map[string]gcOutcome{"kubelet": kube, "imagefleet": ours} {
		if want := ownError(c, o); canonicalError(o.err, false) != canonicalError(want, false) {
			return fmt.Errorf("%s's error %q does not match its removals (want %q)", side, o.err, want)
		}
	}
	return nil
}

// ownError is the kubelet's freeSpace error for a space pass's attempts: the failures aggregated, with the
// bytes it freed.
func ownError(c *gcCase, o gcOutcome) string {
	var fails []string
	for _, a := range o.attempts {
		if !a.ok && !slices.Contains(fails, c.failure(a.id)) {
			fails = append(fails, c.failure(a.id))
		}
	}
	switch len(fails) {
	case 0:
		return ""
	case 1:
	default:
		fails = []string{"[" + strings.Join(fails, ", ") + "]"}
	}
	target := amountToFree(c, o.attempts)
	return fmt.Sprintf("wanted to free %d bytes, but freed %d bytes space with errors in image deletion: %s", target, freedBytes(c, o.attempts)[0], fails[0])
}

func (c *gcCase) failure(id string) string {
	for _, im := range c.images {
		if im.id == id {
			return im.fail
		}
	}
	return ""
}

// freedBytes returns the bytes the space pass freed and the size of its last successful removal.
func freedBytes(c *gcCase, as []attempt) [2]int64 {
	var f [2]int64
	for _, a := range as {
		if a.ok && a.reason == gc.ReasonSpace {
			f[0] += c.size(a.id)
			f[1] = c.size(a.id)
		}
	}
	return f
}

// amountToFree is the kubelet's target, from the stats after the age pass.
func amountToFree(c *gcCase, as []attempt) int64 {
	var listed []string
	last := c.steps[len(c.steps)-1]
	for i, im := range c.images {
		gone := slices.ContainsFunc(as, func(a attempt) bool { return a.id == im.id && a.ok && a.reason == gc.ReasonAge })
		if last.present[i] && !gone {
			listed = append(listed, im.id)
		}
	}
	available := min(c.available(listed), c.capacity)
	return c.capacity*int64(100-c.policy.LowThresholdPercent)/100 - available
}

func casesFromEnv(t *testing.T, name string, def int) int {
	if v := os.Getenv(name); v != "" {
		var n int
		if _, err := fmt.Sscan(v, &n); err != nil || n <= 0 {
			t.Fatalf("%s=%q: want a positive number", name, v)
		}
		return n
	}
	return def
}

// TestImageGCMatchesKubelet runs seeded random cases through the kubelet's image GC manager
// (pkg/kubelet/images, v1.37.2) and imagefleet's GC executor and compares which images each removes, in which
// order (ties as sets), for which reason, the bytes freed (FreedBytes must be the removed images' sizes) and
// the error and FreeDiskSpaceFailed texts (with the freed bytes and usage in them). A dry run must
// remove, in the same order, what the real pass then removes when no removal fails.
func TestImageGCMatchesKubelet(t *testing.T) {
	_, b := bustest.Start(t)
	n := casesFromEnv(t, "KUBELETDIFF_GC_CASES", gcCases)
	excluded := map[string]int{}
	var compared, removals, cuts, failures int
	for seed := range uint64(n) {
		c := newGCCase(seed)
		kube := runKubelet(t, c)
		dry, ours := imagefleetGC(t, b, c)
		if t.Failed() {
			t.Fatalf("case:\n%s", c)
		}
		if why := c.excluded(); why != "" {
			excluded[why]++
			continue
		}
		if slices.ContainsFunc(kube.attempts, func(a attempt) bool { return a.reason == gc.ReasonAge && !a.ok }) {
			excluded[diffAgeErrorContinues]++
			age := func(as []attempt) []attempt {
				return slices.DeleteFunc(slices.Clone(as), func(a attempt) bool { return a.reason != gc.ReasonAge })
			}
			if err := compareGC(c, gcOutcome{attempts: age(kube.attempts)}, gcOutcome{attempts: age(ours.attempts)}); err != nil {
				t.Fatalf("%v\ncase:\n%s\nkubelet:\n%s\nimagefleet:\n%s", err, c, kube, ours)
			}
			if !strings.HasPrefix(canonicalError(ours.err, false), canonicalError(kube.err, false)) {
				t.Fatalf("imagefleet's error %q does not start with the kubelet's age-pass error %q\ncase:\n%s", ours.err, kube.err, c)
			}
			continue
		}
		compared++
		if err := compareGC(c, kube, ours); err != nil {
			t.Fatalf("%v\ncase:\n%s\nkubelet:\n%s\nimagefleet:\n%s", err, c, kube, ours)
		}
		anyFail := false
		for _, a := range ours.attempts {
			anyFail = anyFail || !a.ok
			if a.ok {
				removals++
			}
		}
		if anyFail {
			failures++
			continue
		}
		if !slices.Equal(dry.attempts, ours.attempts) || dry.err != ours.err || dry.freed != ours.freed {
			t.Fatalf("the dry run is not the pass\ncase:\n%s\ndry run:\n%s\npass:\n%s", c, dry, ours)
		}
		if len(groups(c, kube.attempts)) > 0 && !slices.Equal(kube.attempts, ours.attempts) {
			cuts++ // the kubelet broke a tie otherwise
		}
	}
	t.Logf("%d cases: %d compared in full (%d removals, %d with failed removals, %d where the kubelet's random tie order differed), excluded: %v",
		n, compared, removals, failures, cuts, excluded)
	if compared < n/2 {
		t.Errorf("only %d of %d cases compared in full: the exclusions hide too much", compared, n)
	}
}
