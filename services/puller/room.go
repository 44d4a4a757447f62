package puller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	goruntime "runtime"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/sync/singleflight"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// room makes room on the image filesystem before a runtime pull. The kubelet pulls whatever the usage and
// leaves the disk to the 5-minute image GC and the eviction manager, so a pull on a full disk fails halfway
// with "no space left on device". Here, before a runtime pull:
//
//   - the image's size is asked of the registry (the manifest's layers and config, with the request's
//     credentials; an index resolves to the node's platform), or, when the registry does not answer,
//     Margin percent of the filesystem stands for it;
//   - when usage is at or above the GC high threshold, or the available bytes are below that size, the
//     puller asks the node's GC executor for a pass (imagefleet.cmd.<node>.gc, trigger "pull"; workers never
//     import each other) and pulls after it. Concurrent pulls share one pass;
//   - if the available bytes are still below the size, the pull fails at once with a message naming the
//     sizes, instead of failing halfway.
//
// A failing measure (no ImageFsInfo, statfs error) or no GC executor on the node never blocks a pull that
// fits.
type room struct {
	node   string
	high   int // GC high threshold percent
	margin int // percent of capacity standing for an unknown image size
	fs     func(ctx context.Context) (capacity, available int64, err error)
	size   func(ctx context.Context, image string, auth *cri.AuthConfig) (int64, error)
	gc     func(ctx context.Context) (events.GCResult, error)
	log    *slog.Logger
	passes singleflight.Group
}

// errNoRoom is the error of a pull refused for want of room (its message names the sizes).
var errNoRoom = errors.New("no room on the image filesystem")

// make returns nil when the pull may go ahead.
func (r *room) make(ctx context.Context, image string, auth *cri.AuthConfig) error {
	capacity, available, err := r.fs(ctx)
	if err != nil || capacity <= 0 {
		r.log.Debug("image fs stats before pull failed, pulling", "err", err)
		return nil
	}
	need, known := int64(0), true
	if r.size != nil {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		need, err = r.size(sctx, image, auth)
		cancel()
		if err != nil {
			r.log.Debug("image size from the registry unknown, using the margin", "image", image, "err", err)
		}
	}
	if r.size == nil || err != nil || need <= 0 {
		need, known = capacity*int64(r.margin)/100, false
	}
	usage := 100 - int(min(available, capacity)*100/capacity)
	if usage < r.high && available >= need {
		return nil
	}
	r.log.Info("making room before a pull", "image", image, "usage", usage, "high_threshold", r.high,
		"available", available, "image_size", need, "size_known", known)
	v, gcErr, _ := r.passes.Do("gc", func() (any, error) { return r.gc(context.WithoutCancel(ctx)) })
	if gcErr != nil && !errors.Is(gcErr, bus.ErrNoResponders) {
		r.log.Warn("image GC before pull", "image", image, "err", gcErr)
	}
	capacity, available, err = r.fs(ctx)
	if err != nil || capacity <= 0 || available >= need {
		return nil
	}
	what := "its size in the registry"
	if !known {
		what = fmt.Sprintf("the %d%% margin for an image of unknown size", r.margin)
	}
	after := "after image GC"
	if res, ok := v.(events.GCResult); ok && gcErr == nil {
		after = fmt.Sprintf("after image GC removed %d images (%d failed)", len(res.Succeeded()), res.FailedCount())
	} else if gcErr != nil {
		after = "and image GC could not run (" + gcErr.Error() + ")"
	}
	return fmt.Errorf("%w: image %q needs %s (%d bytes, %s) but the image filesystem has %s available of %s %s",
		errNoRoom, image, formatBytes(need), need, what, formatBytes(available), formatBytes(capacity), after)
}

// formatBytes is the kubelet's formatSize (B, KiB, MiB, GiB, TiB with one decimal).
func formatBytes(n int64) string {
	const unit = 1024
	f := float64(n)
	switch {
	case f < unit:
		return fmt.Sprintf("%d B", n)
	case f < unit*unit:
		return fmt.Sprintf("%.1f KiB", f/unit)
	case f < unit*unit*unit:
		return fmt.Sprintf("%.1f MiB", f/(unit*unit))
	case f < unit*unit*unit*unit:
		return fmt.Sprintf("%.1f GiB", f/(unit*unit*unit))
	}
	return fmt.Sprintf("%.1f TiB", f/(unit*unit*unit*unit))
}

// registrySize is the image's size in the registry: the sum of its layers' and config's sizes in the
// manifest (for an index, the manifest of the node's platform), read with the pull's credentials.
func registrySize(ctx context.Context, image string, auth *cri.AuthConfig) (int64, error) {
	ref, err := name.ParseReference(image)
	if err != nil {
		return 0, err
	}
	opts := []remote.Option{remote.WithContext(ctx),
		remote.WithPlatform(v1.Platform{OS: "linux", Architecture: goruntime.GOARCH})}
	if auth != nil {
		opts = append(opts, remote.WithAuth(authn.FromConfig(authn.AuthConfig{Username: auth.Username,
			Password: auth.Password, Auth: auth.Auth, IdentityToken: auth.IdentityToken, RegistryToken: auth.RegistryToken})))
	}
	img, err := remote.Image(ref, opts...)
	if err != nil {
		return 0, err
	}
	m, err := img.Manifest()
	if err != nil {
		return 0, err
	}
	total := m.Config.Size
	for _, l := range m.Layers {
		total += l.Size
	}
	return total, nil
}

// imageFsFunc measures the runtime's image filesystem: ImageFsInfo's mountpoint, then statfs.
func imageFsFunc(rt interface {
	ImageFsInfo(ctx context.Context) ([]cri.FsInfo, error)
}) func(ctx context.Context) (int64, int64, error) {
	return func(ctx context.Context) (int64, int64, error) {
		fs, err := rt.ImageFsInfo(ctx)
		if err != nil {
			return 0, 0, err
		}
		if len(fs) == 0 || fs[0].Mountpoint == "" {
			return 0, 0, errors.New("the runtime reports no image filesystem mountpoint")
		}
		return cri.Statfs(fs[0].Mountpoint)
	}
}

// busGC asks the node's GC executor for a pass over NATS.
func busGC(b *bus.Bus, node string, timeout time.Duration) func(ctx context.Context) (events.GCResult, error) {
	return func(ctx context.Context) (events.GCResult, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		var res events.GCResult
		err := b.Request(ctx, events.CommandSubject(node, events.VerbGC), events.GCRequest{Trigger: events.GCTriggerPull}, &res)
		return res, err
	}
}
