package fleettest

import (
	"context"
	"fmt"
	"sync"

	"github.com/imagefleet/imagefleet/services/cri"
)

// FakeRuntime is an in-memory Runtime (and heartbeat runtime) for unit tests.
type FakeRuntime struct {
	mu         sync.Mutex
	images     map[string]cri.Image
	containers []cri.Container
	// PullErr, when set, fails every pull.
	PullErr error
}

// NewFakeRuntime returns a runtime holding imgs.
func NewFakeRuntime(imgs ...cri.Image) *FakeRuntime {
	f := &FakeRuntime{images: map[string]cri.Image{}}
	for _, im := range imgs {
		f.images[im.ID] = im
	}
	return f
}

// Use adds a container using image id.
func (f *FakeRuntime) Use(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.containers = append(f.containers, cri.Container{ID: fmt.Sprintf("c%d", len(f.containers)), ImageID: id, State: cri.ContainerRunning})
}

// ListImages lists the images.
func (f *FakeRuntime) ListImages(context.Context) ([]cri.Image, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]cri.Image, 0, len(f.images))
	for _, im := range f.images {
		out = append(out, im)
	}
	return out, nil
}

// ListContainers lists the containers.
func (f *FakeRuntime) ListContainers(context.Context) ([]cri.Container, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]cri.Container(nil), f.containers...), nil
}

// RemoveImage removes an image.
func (f *FakeRuntime) RemoveImage(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.images[id]; !ok {
		return fmt.Errorf("remove image %q: %w", id, cri.ErrNotFound)
	}
	delete(f.images, id)
	return nil
}

// PullImage adds an image named ref (ID "sha256:" + ref's length-padded name) unless PullErr is set.
func (f *FakeRuntime) PullImage(_ context.Context, ref string, _ *cri.AuthConfig, _ *cri.SandboxConfig, _ map[string]string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.PullErr != nil {
		return "", f.PullErr
	}
	id := "sha256:pulled-" + ref
	f.images[id] = cri.Image{ID: id, RepoTags: []string{ref}, Size: 1 << 20}
	return id, nil
}

// Images returns how many images the runtime holds.
func (f *FakeRuntime) Images() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.images)
}

// Version reports a fake runtime name and version.
func (f *FakeRuntime) Version(context.Context) (string, string, error) { return "fake", "1.0.0", nil }

// ImageFsInfo reports the sum of image sizes on /fake/images.
func (f *FakeRuntime) ImageFsInfo(context.Context) ([]cri.FsInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var used uint64
	for _, im := range f.images {
		used += uint64(im.Size)
	}
	return []cri.FsInfo{{Mountpoint: "/fake/images", UsedBytes: used}}, nil
}
