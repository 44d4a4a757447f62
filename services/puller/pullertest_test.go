package puller

import (
	"context"
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/services/cri"
)

// fakeImages is the kubelet's FakeRuntime image service: it records calls by the kubelet's names, keeps an
// image list of IDs (an image's ID is its spec image), fails pulls with Err and inspections of missing images
// with InspectErr, and can block pulls until released.
type fakeImages struct {
	mu         sync.Mutex
	calls      []string
	images     []string
	err        error
	inspectErr error
	block      bool
	release    chan error // a value releases one blocked pull: nil succeeds, an error fails it
	auths      []*cri.AuthConfig

	pulls, inFlight, maxInFlight atomic.Int64
}

func newFakeImages(images ...string) *fakeImages {
	return &fakeImages{images: images, release: make(chan error, 100)}
}

func (f *fakeImages) record(call string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call)
}

func (f *fakeImages) resetCalls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.calls
	f.calls = nil
	return c
}

func (f *fakeImages) GetImageRef(_ context.Context, image string) (string, error) {
	f.record("GetImageRef")
	f.mu.Lock()
	defer f.mu.Unlock()
	if slices.Contains(f.images, image) {
		return image, nil
	}
	return "", f.inspectErr
}

func (f *fakeImages) PullImage(ctx context.Context, image string, auth *cri.AuthConfig, _ *cri.SandboxConfig, _ map[string]string) (string, error) {
	f.record("PullImage")
	f.pulls.Add(1)
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	for {
		m := f.maxInFlight.Load()
		if n <= m || f.maxInFlight.CompareAndSwap(m, n) {
			break
		}
	}
	f.mu.Lock()
	f.auths = append(f.auths, auth)
	block := f.block
	f.mu.Unlock()
	if block {
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case err := <-f.release:
			if err != nil {
				return "", err
			}
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return "", f.err
	}
	if !slices.Contains(f.images, image) {
		f.images = append(f.images, image)
	}
	return image, nil
}

func (f *fakeImages) GetImageSize(_ context.Context, _ string) (uint64, error) {
	f.record("GetImageSize")
	return 1 << 20, nil
}

// staticCreds is a credential source that answers the same credentials for every image.
type staticCreds []Credential

func (s staticCreds) Lookup(context.Context, string, Request) ([]Credential, error) { return s, nil }

type harness struct {
	m     *manager
	rt    *fakeImages
	clock *critest.Clock
	reg   *prometheus.Registry
	recs  *memRecords
}

type harnessOpts struct {
	serial      bool
	maxParallel int
	qps         float64
	burst       int
	gateOff     bool
	creds       credentialSource
	images      []string
}

// newHarness is the kubelet's pullerTestEnv: backoff 1s..1min on a fake clock, one present image.
func newHarness(o harnessOpts) *harness {
	clock := critest.NewClock(time.Date(2026, 7, 22, 10, 0, 0, 0, time.UTC))
	rt := newFakeImages("present_image:latest")
	if o.images != nil {
		rt = newFakeImages(o.images...)
	}
	reg := prometheus.NewRegistry()
	met, err := newMetrics(reg)
	if err != nil {
		panic(err)
	}
	tokens := o.maxParallel
	if o.serial {
		tokens = 1
	}
	recs := newMemRecords()
	mc := managerConfig{tokens: tokens, qps: o.qps, burst: o.burst, backoff: backoffPolicy{initial: time.Second, max: time.Minute},
		verifyPolicy: NeverVerifyPreloadedImages, now: clock.Now, log: slog.New(slog.DiscardHandler), secretPulledImagesOff: o.gateOff}
	creds := o.creds
	if creds == nil {
		creds = staticCreds(nil)
	}
	return &harness{m: newManager(mc, rt, creds, newMemBackoff(), recs, met), rt: rt, clock: clock, reg: reg, recs: recs}
}

func reasons(evs []KubeEvent) []string {
	out := []string{}
	for _, e := range evs {
		out = append(out, e.Reason)
	}
	return out
}

func fmtCalls(c []string) string { return fmt.Sprintf("%v", c) }
