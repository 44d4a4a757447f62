package hollow

import (
	"context"
	"encoding/base64"
	"fmt"
	"strings"
	"time"

	"github.com/distribution/reference"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// imageService is the runtime's CRI ImageService. It is a type of its own because the generated
// Unimplemented servers of both services have a method of the same name, and because the test helpers
// on Runtime (RemoveContainer, ...) would clash with the CRI method names.
type imageService struct {
	runtimeapi.UnimplementedImageServiceServer
	r *Runtime
}

// streamChunk is how many items a Stream* call sends per message.
const streamChunk = 1000

func (s *imageService) ListImages(_ context.Context, req *runtimeapi.ListImagesRequest) (*runtimeapi.ListImagesResponse, error) {
	s.r.record("ListImages")
	return &runtimeapi.ListImagesResponse{Images: s.r.filterImages(req.GetFilter())}, nil
}

func (s *imageService) StreamImages(req *runtimeapi.StreamImagesRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamImagesResponse]) error {
	s.r.record("StreamImages")
	return sendChunks(s.r.filterImages(req.GetFilter()), func(l []*runtimeapi.Image) error {
		return stream.Send(&runtimeapi.StreamImagesResponse{Images: l})
	})
}

// filterImages returns every image, or the one the filter's image spec names (none if it names nothing).
func (r *Runtime) filterImages(f *runtimeapi.ImageFilter) []*runtimeapi.Image {
	ref := f.GetImage().GetImage()
	if ref == "" {
		return r.listImages()
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	if im := r.resolveLocked(ref); im != nil {
		return []*runtimeapi.Image{im}
	}
	return nil
}

// sendChunks sends items in messages of streamChunk, at least one message (streams send at least one
// list, possibly empty, before EOF).
func sendChunks[T any](items []T, send func([]T) error) error {
	for {
		n := min(len(items), streamChunk)
		if err := send(items[:n:n]); err != nil {
			return err
		}
		items = items[n:]
		if len(items) == 0 {
			return nil
		}
	}
}

// ImageStatus answers a nil image for one the runtime does not have, as CRI requires.
func (s *imageService) ImageStatus(_ context.Context, req *runtimeapi.ImageStatusRequest) (*runtimeapi.ImageStatusResponse, error) {
	s.r.record("ImageStatus")
	s.r.mu.RLock()
	defer s.r.mu.RUnlock()
	return &runtimeapi.ImageStatusResponse{Image: s.r.resolveLocked(req.GetImage().GetImage())}, nil
}

// PullImage stores the image a reference names, after PullLatency, the pull gate, the registry's
// credential check and any injected failure, in that order. Pulling a reference the node has returns
// the image it has.
func (s *imageService) PullImage(ctx context.Context, req *runtimeapi.PullImageRequest) (*runtimeapi.PullImageResponse, error) {
	r := s.r
	r.record("PullImage")
	done := r.pullStarted()
	defer done()

	ref := req.GetImage().GetImage()
	named, err := normalize(ref)
	if err != nil {
		// containerd answers Unknown here; InvalidArgument lets the client map it to cri.ErrInvalid.
		return nil, status.Errorf(codes.InvalidArgument, "failed to parse image reference %q: %v", ref, err)
	}
	norm := named.String()
	if err := r.gate.pass(ctx); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	if r.latency > 0 {
		t := time.NewTimer(r.latency)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if cred, ok := r.auth[reference.Domain(named)]; ok && !cred.matches(req.GetAuth()) {
		return nil, unauthorized(named)
	}
	if err := r.failPulls[norm]; err != nil {
		return nil, err
	}
	if id, ok := r.refs[norm]; ok {
		return &runtimeapi.PullImageResponse{ImageRef: id}, nil
	}
	im := &runtimeapi.Image{Id: imageID(norm), RepoDigests: []string{repoDigest(named)}}
	if _, digested := named.(reference.Canonical); !digested {
		im.RepoTags = []string{norm} // containerd lists no tag for an image pulled by digest
	}
	if old, ok := r.images[im.Id]; ok {
		im = cloneImage(old) // the image was stored by ID (AddImage) and this reference lost it since
		im.RepoTags = appendMissing(im.RepoTags, norm)
		im.RepoDigests = appendMissing(im.RepoDigests, repoDigest(named))
	} else {
		im.Size = uint64(r.sizeOf(norm))
	}
	im.Pinned = im.Pinned || r.isPinned(im)
	r.putImageLocked(im)
	return &runtimeapi.PullImageResponse{ImageRef: im.Id}, nil
}

func appendMissing(l []string, s string) []string {
	for _, x := range l {
		if x == s {
			return l
		}
	}
	return append(l, s)
}

func (c credential) matches(a *runtimeapi.AuthConfig) bool {
	if a == nil {
		return false
	}
	if a.Username == c.user && a.Password == c.pass {
		return true
	}
	if a.Auth == "" {
		return false
	}
	b, err := base64.StdEncoding.DecodeString(a.Auth)
	return err == nil && string(b) == c.user+":"+c.pass
}

// unauthorized is containerd's error for a registry's 401 on the manifest HEAD request.
func unauthorized(named reference.Named) error {
	host, scheme := reference.Domain(named), "https"
	switch {
	case host == "docker.io":
		host = "registry-1.docker.io"
	case isLoopback(host):
		scheme = "http" // containerd's CRI talks plain HTTP to a registry on loopback
	}
	object := "latest"
	if c, ok := named.(reference.Canonical); ok {
		object = c.Digest().String()
	} else if t, ok := named.(reference.Tagged); ok {
		object = t.Tag()
	}
	return status.Error(codes.Unknown, fmt.Sprintf(
		"failed to pull and unpack image %q: failed to resolve reference %q: unexpected status from HEAD request to %s://%s/v2/%s/manifests/%s: 401 Unauthorized",
		named.String(), named.String(), scheme, host, reference.Path(named), object))
}

func isLoopback(host string) bool {
	return strings.HasPrefix(host, "localhost") || strings.HasPrefix(host, "127.") || strings.HasPrefix(host, "[::1]")
}

// RemoveImage removes an image (by ID, tag or digest reference) with all its references. A missing image
// is success, as containerd answers.
func (s *imageService) RemoveImage(_ context.Context, req *runtimeapi.RemoveImageRequest) (*runtimeapi.RemoveImageResponse, error) {
	r := s.r
	r.record("RemoveImage")
	r.removes.Add(1)
	r.mu.Lock()
	defer r.mu.Unlock()
	if im := r.resolveLocked(req.GetImage().GetImage()); im != nil {
		r.deleteImageLocked(im)
	}
	return &runtimeapi.RemoveImageResponse{}, nil
}

// ImageFsInfo reports one image filesystem, /hollow/<name>/images, whose used bytes are the sum of the
// image sizes at the moment of the call (containerd refreshes its figure every 10 s).
func (s *imageService) ImageFsInfo(context.Context, *runtimeapi.ImageFsInfoRequest) (*runtimeapi.ImageFsInfoResponse, error) {
	r := s.r
	r.record("ImageFsInfo")
	r.mu.RLock()
	used, n := r.usedBytes, len(r.images)
	r.mu.RUnlock()
	return &runtimeapi.ImageFsInfoResponse{ImageFilesystems: []*runtimeapi.FilesystemUsage{{
		Timestamp:  time.Now().UnixNano(),
		FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: r.mountpoint},
		UsedBytes:  &runtimeapi.UInt64Value{Value: used},
		InodesUsed: &runtimeapi.UInt64Value{Value: uint64(n)},
	}}}, nil
}
