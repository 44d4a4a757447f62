package cri

import (
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Config configures a Client.
type Config struct {
	// Endpoint is the CRI socket: unix:///run/containerd/containerd.sock (a bare path is taken as unix).
	Endpoint string
	// Timeout bounds every call except pulls (default 2m, the kubelet's runtime-request-timeout).
	Timeout time.Duration
	// PullTimeout bounds a pull (default 0: only the caller's context).
	PullTimeout time.Duration
}

// Client is a CRI client over gRPC.
type Client struct {
	conn    *grpc.ClientConn
	rt      runtimeapi.RuntimeServiceClient
	img     runtimeapi.ImageServiceClient
	timeout time.Duration
	pullTO  time.Duration
}

// maxMsgSize matches the kubelet's CRI client (16 MiB): a node with many images has a large ListImages.
const maxMsgSize = 1024 * 1024 * 16

// Dial connects to the runtime. The connection is lazy: a runtime that is not up yet fails the first call
// with ErrUnavailable, and later calls reconnect.
func Dial(cfg Config) (*Client, error) {
	if cfg.Endpoint == "" {
		return nil, fmt.Errorf("CRI endpoint is empty")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Minute
	}
	target := cfg.Endpoint
	if strings.HasPrefix(target, "/") {
		target = "unix://" + target
	}
	if !strings.HasPrefix(target, "unix://") && !strings.HasPrefix(target, "passthrough:") {
		return nil, fmt.Errorf("CRI endpoint %q: only unix sockets are supported (unix:///path)", cfg.Endpoint)
	}
	// The kubelet's CRI client's reconnect backoff (k8s.io/cri-client remote_runtime.go: base 100 ms, max
	// 3 s, minimum connect timeout 5 s), not gRPC's default (1 s doubling by 1.6 up to 120 s): a runtime
	// restarted after a few seconds down is used again within 3 s, not after a backoff grown meanwhile.
	params := grpc.ConnectParams{Backoff: backoff.DefaultConfig, MinConnectTimeout: 5 * time.Second}
	params.Backoff.BaseDelay, params.Backoff.MaxDelay = 100*time.Millisecond, 3*time.Second
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)),
		grpc.WithConnectParams(params),
	)
	if err != nil {
		return nil, fmt.Errorf("dial CRI %s: %w", cfg.Endpoint, err)
	}
	return NewFromConn(conn, cfg), nil
}

// NewFromConn wraps an existing gRPC connection (tests, the hollow runtime over bufconn).
func NewFromConn(conn *grpc.ClientConn, cfg Config) *Client {
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Minute
	}
	return &Client{conn: conn, rt: runtimeapi.NewRuntimeServiceClient(conn),
		img: runtimeapi.NewImageServiceClient(conn), timeout: cfg.Timeout, pullTO: cfg.PullTimeout}
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

func (c *Client) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.timeout)
}

// Version returns the runtime's name and version.
func (c *Client) Version(ctx context.Context) (name, version string, err error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.rt.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		return "", "", mapErr("version", err)
	}
	return r.RuntimeName, r.RuntimeVersion, nil
}

// ListImages lists every image.
func (c *Client) ListImages(ctx context.Context) ([]Image, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.img.ListImages(ctx, &runtimeapi.ListImagesRequest{})
	if err != nil {
		return nil, mapErr("list images", err)
	}
	out := make([]Image, 0, len(r.Images))
	for _, im := range r.Images {
		out = append(out, fromCRIImage(im))
	}
	return out, nil
}

func fromCRIImage(im *runtimeapi.Image) Image {
	return Image{ID: im.Id, RepoTags: im.RepoTags, RepoDigests: im.RepoDigests, Size: int64(im.GetSize()), Pinned: im.Pinned}
}

// ImageStatus returns the image ref resolves to, or ErrNotFound (CRI answers a nil image for a missing one).
func (c *Client) ImageStatus(ctx context.Context, ref string) (Image, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.img.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil {
		return Image{}, mapErr(fmt.Sprintf("image status %q", ref), err)
	}
	if r.Image == nil {
		return Image{}, fmt.Errorf("image status %q: %w", ref, ErrNotFound)
	}
	return fromCRIImage(r.Image), nil
}

// PullImage pulls ref with optional credentials and returns the image reference (ID) the runtime reports.
func (c *Client) PullImage(ctx context.Context, ref string, auth *AuthConfig, sandbox *SandboxConfig, annotations map[string]string) (string, error) {
	if c.pullTO > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.pullTO)
		defer cancel()
	}
	req := &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref, Annotations: annotations}}
	if auth != nil {
		req.Auth = &runtimeapi.AuthConfig{Username: auth.Username, Password: auth.Password, Auth: auth.Auth,
			ServerAddress: auth.ServerAddress, IdentityToken: auth.IdentityToken, RegistryToken: auth.RegistryToken}
	}
	if sandbox != nil {
		req.SandboxConfig = &runtimeapi.PodSandboxConfig{
			Metadata:    &runtimeapi.PodSandboxMetadata{Name: sandbox.Name, Namespace: sandbox.Namespace, Uid: sandbox.UID},
			Annotations: sandbox.Annotations,
		}
	}
	r, err := c.img.PullImage(ctx, req)
	if err != nil {
		return "", mapErr(fmt.Sprintf("pull image %q", ref), err)
	}
	return r.ImageRef, nil
}

// RemoveImage removes an image by ID or reference. A missing image returns an error wrapping ErrNotFound
// (CRI runtimes usually answer success; callers treat both as "already gone").
func (c *Client) RemoveImage(ctx context.Context, id string) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	if _, err := c.img.RemoveImage(ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: id}}); err != nil {
		return mapErr(fmt.Sprintf("remove image %q", id), err)
	}
	return nil
}

// ImageFsInfo returns the image filesystems the runtime reports (the first is the image filesystem).
func (c *Client) ImageFsInfo(ctx context.Context) ([]FsInfo, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.img.ImageFsInfo(ctx, &runtimeapi.ImageFsInfoRequest{})
	if err != nil {
		return nil, mapErr("image fs info", err)
	}
	var out []FsInfo
	for _, fs := range r.ImageFilesystems {
		fi := FsInfo{Timestamp: time.Unix(0, fs.Timestamp)}
		if fs.FsId != nil {
			fi.Mountpoint = fs.FsId.Mountpoint
		}
		if fs.UsedBytes != nil {
			fi.UsedBytes = fs.UsedBytes.Value
		}
		out = append(out, fi)
	}
	return out, nil
}

// ListContainers lists every container the runtime still knows, running or exited.
func (c *Client) ListContainers(ctx context.Context) ([]Container, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
	if err != nil {
		return nil, mapErr("list containers", err)
	}
	out := make([]Container, 0, len(r.Containers))
	for _, ct := range r.Containers {
		c := Container{ID: ct.Id, PodSandboxID: ct.PodSandboxId, ImageID: ct.ImageId, State: ContainerState(ct.State), Labels: ct.Labels}
		if c.ImageID == "" {
			c.ImageID = ct.ImageRef // pre-1.30 runtimes: the kubelet falls back to image_ref
		}
		if ct.Metadata != nil {
			c.Name = ct.Metadata.Name
		}
		if ct.Image != nil {
			c.Image = ct.Image.Image
		}
		out = append(out, c)
	}
	return out, nil
}
