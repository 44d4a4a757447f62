// Package critest has the one in-memory CRI runtime and the one settable clock for unit tests. Tests that
// need a real CRI server over gRPC use services/cri/hollow (in memory) or containerd.
package critest

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/imagefleet/imagefleet/services/cri"
)

// Runtime is a fake CRI runtime in the spirit of the kubelet's containertest.FakeRuntime: images in list
// order, containers, injectable failures and a call log. Its setters are safe at any time.
type Runtime struct {
	mu         sync.Mutex
	images     []cri.Image
	containers []cri.Container
	// mountpoint is what ImageFsInfo reports (default "/fake/images").
	mountpoint string
	pullErr    error
	fsErr      error
	listErr    error
	removeErr  map[string]error
	onRemove   func(id string)
	calls      []string
	removeGate chan struct{}
	// removedBytes is the sum of the sizes of the images removed so far.
	removedBytes int64
	// fsUsed is the image filesystem usage ImageFsInfo reports.
	fsUsed uint64

	inFlight, maxInFlight int
}

// NewRuntime returns a runtime listing images.
func NewRuntime(images ...cri.Image) *Runtime {
	return &Runtime{images: slices.Clone(images), mountpoint: "/fake/images", removeErr: map[string]error{}}
}

// SetImages replaces the image list.
func (r *Runtime) SetImages(images ...cri.Image) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.images = slices.Clone(images)
}

// SetContainers replaces the container list (every container the runtime lists, running or exited).
func (r *Runtime) SetContainers(cs ...cri.Container) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.containers = slices.Clone(cs)
}

// FailRemove makes RemoveImage(id) fail with err (nil: succeed again).
func (r *Runtime) FailRemove(id string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		delete(r.removeErr, id)
		return
	}
	r.removeErr[id] = err
}

// Use adds a running container using image id.
func (r *Runtime) Use(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.containers = append(r.containers, cri.Container{ID: fmt.Sprintf("c%d", len(r.containers)), ImageID: id, State: cri.ContainerRunning})
}

// FailPull makes every PullImage fail with err (nil: succeed again).
func (r *Runtime) FailPull(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pullErr = err
}

// FailImageFs makes ImageFsInfo fail with err.
func (r *Runtime) FailImageFs(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fsErr = err
}

// FailList makes ListImages and ListContainers fail with err.
func (r *Runtime) FailList(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.listErr = err
}

// OnRemove runs fn(id) at the start of every RemoveImage, outside the lock.
func (r *Runtime) OnRemove(fn func(id string)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.onRemove = fn
}

// GateRemovals makes every RemoveImage wait until the returned channel is closed (to measure concurrency).
func (r *Runtime) GateRemovals() chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.removeGate = make(chan struct{})
	return r.removeGate
}

// ListImages lists the images.
func (r *Runtime) ListImages(context.Context) ([]cri.Image, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "ListImages")
	if r.listErr != nil {
		return nil, r.listErr
	}
	return slices.Clone(r.images), nil
}

// ListContainers lists the containers.
func (r *Runtime) ListContainers(context.Context) ([]cri.Container, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "ListContainers")
	if r.listErr != nil {
		return nil, r.listErr
	}
	return slices.Clone(r.containers), nil
}

// RemoveImage removes the first image with the ID, as the kubelet's fake runtime does. A missing image
// returns an error wrapping cri.ErrNotFound.
func (r *Runtime) RemoveImage(ctx context.Context, id string) error {
	r.mu.Lock()
	r.calls = append(r.calls, "RemoveImage "+id)
	hook, gate := r.onRemove, r.removeGate
	r.inFlight++
	r.maxInFlight = max(r.maxInFlight, r.inFlight)
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.inFlight--
		r.mu.Unlock()
	}()
	if hook != nil {
		hook(id)
	}
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.removeErr[id]; err != nil {
		return err
	}
	i := slices.IndexFunc(r.images, func(im cri.Image) bool { return im.ID == id })
	if i < 0 {
		return fmt.Errorf("remove image %q: %w", id, cri.ErrNotFound)
	}
	r.removedBytes += r.images[i].Size
	r.images = slices.Delete(r.images, i, i+1)
	return nil
}

// PullImage adds an image named ref with ID "sha256:pulled-"+ref and 1 MiB (once) unless FailPull set an
// error, and returns the ID.
func (r *Runtime) PullImage(_ context.Context, ref string, _ *cri.AuthConfig, _ *cri.SandboxConfig, _ map[string]string) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "PullImage "+ref)
	if r.pullErr != nil {
		return "", r.pullErr
	}
	id := "sha256:pulled-" + ref
	if !slices.ContainsFunc(r.images, func(im cri.Image) bool { return im.ID == id }) {
		r.images = append(r.images, cri.Image{ID: id, RepoTags: []string{ref}, Size: 1 << 20})
	}
	return id, nil
}

// Version reports the runtime name "fake" and version "1.0.0".
func (r *Runtime) Version(context.Context) (string, string, error) { return "fake", "1.0.0", nil }

// RemovedBytes is the sum of the sizes of the images RemoveImage removed so far (what a disk would have
// gained back).
func (r *Runtime) RemovedBytes() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.removedBytes
}

// ImageFsInfo reports one image filesystem at the mountpoint.
func (r *Runtime) ImageFsInfo(context.Context) ([]cri.FsInfo, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "ImageFsInfo")
	if r.fsErr != nil {
		return nil, r.fsErr
	}
	return []cri.FsInfo{{Mountpoint: r.mountpoint, UsedBytes: r.fsUsed}}, nil
}

// SetFsUsed sets the usage ImageFsInfo reports (containerd reports its snapshots' usage).
func (r *Runtime) SetFsUsed(n uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fsUsed = n
}

// Images returns the IDs of the images listed now, in list order.
func (r *Runtime) Images() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.images))
	for _, im := range r.images {
		out = append(out, im.ID)
	}
	return out
}

// Calls returns the call log.
func (r *Runtime) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// InFlight returns the removals running now and the most that ever ran at once.
func (r *Runtime) InFlight() (now, most int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.inFlight, r.maxInFlight
}

// Clock is a settable clock for tests.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock at t.
func NewClock(t time.Time) *Clock { return &Clock{t: t} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Step moves the clock by d.
func (c *Clock) Step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// Set sets the clock.
func (c *Clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}
