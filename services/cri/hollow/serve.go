package hollow

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/imagefleet/imagefleet/services/cri"
)

// maxMsgSize matches the CRI client's and the kubelet's limit (16 MiB): a node with many images has a large
// ListImages (10,000 images are about 2.5 MB).
const maxMsgSize = 16 << 20

// Register puts the runtime's CRI RuntimeService and ImageService on srv, for a caller that hosts them on
// a gRPC server of its own. Serve does this itself.
func (r *Runtime) Register(srv grpc.ServiceRegistrar) {
	runtimeapi.RegisterRuntimeServiceServer(srv, &runtimeService{r: r})
	runtimeapi.RegisterImageServiceServer(srv, &imageService{r: r})
}

// Serve serves CRI on lis until ctx ends, then stops gracefully: calls in flight get Options.StopTimeout
// to finish before they are cancelled. It returns nil after that stop, and no goroutine it started (gRPC's
// handlers included) outlives it. It closes lis.
func (r *Runtime) Serve(ctx context.Context, lis net.Listener) error {
	return r.serve(ctx, lis)
}

// serve is Serve with more server options.
func (r *Runtime) serve(ctx context.Context, lis net.Listener, more ...grpc.ServerOption) error {
	srv := grpc.NewServer(append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxMsgSize),
		// Stop waits for the handlers to return, so none outlives Serve.
		grpc.WaitForHandlers(true),
		// An idle connection gives its 32 KiB write buffer back: a thousand nodes each with a client
		// connection would otherwise hold 32 MiB of write buffers doing nothing.
		grpc.SharedWriteBuffer(true),
	}, more...)...)
	r.Register(srv)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	r.log.Debug("hollow runtime serving", "node", r.name, "addr", lis.Addr().String())

	select {
	case err := <-errc:
		srv.Stop() // the listener failed: end the connections it had accepted, and their handlers
		return fmt.Errorf("serve hollow runtime %s: %w", r.name, err)
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	t := time.NewTimer(r.stopTimeout)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
		r.log.Warn("hollow runtime cancelling calls in flight", "node", r.name, "after", r.stopTimeout)
		srv.Stop()
		<-stopped
	}
	if err := <-errc; err != nil {
		return fmt.Errorf("serve hollow runtime %s: %w", r.name, err)
	}
	r.log.Debug("hollow runtime stopped", "node", r.name)
	return nil
}

// maxSocketPath is the longest unix socket path Linux accepts (sun_path is 108 bytes with its NUL).
const maxSocketPath = 107

// ListenUnix listens on a unix socket at path, creating its directory. A socket file that nobody answers
// on (left by a runtime that died) is removed first; one that answers is in use and an error, and so is a
// file that is not a socket.
func ListenUnix(path string) (net.Listener, error) {
	if len(path) > maxSocketPath {
		return nil, fmt.Errorf("listen %s: socket path is %d bytes, longer than the %d unix sockets allow", path, len(path), maxSocketPath)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("listen %s: the file exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			_ = c.Close() // only a probe
			return nil, fmt.Errorf("listen %s: socket in use", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("listen %s: remove stale socket: %w", path, err)
		}
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	return lis, nil
}

// StartUnix serves the runtime on a unix socket at path in the background until ctx ends or stop is
// called, and returns its CRI endpoint (unix:///abs/path) for cri.Dial. stop returns once the server has
// stopped and removed its socket; it may be called more than once, and suits t.Cleanup.
func (r *Runtime) StartUnix(ctx context.Context, path string) (endpoint string, stop func(), err error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", nil, fmt.Errorf("start hollow runtime %s: %w", r.name, err)
	}
	lis, err := ListenUnix(abs)
	if err != nil {
		return "", nil, fmt.Errorf("start hollow runtime %s: %w", r.name, err)
	}
	return "unix://" + abs, r.serveInBackground(ctx, lis), nil
}

// serveInBackground runs Serve on lis and returns the func that stops it and waits. An error of Serve's
// own (not a stop) is logged: there is no caller left to return it to.
func (r *Runtime) serveInBackground(ctx context.Context, lis net.Listener, more ...grpc.ServerOption) func() {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := r.serve(ctx, lis, more...); err != nil {
			r.log.Error("hollow runtime failed", "node", r.name, "err", err)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// Dial serves the runtime in-process over an in-memory connection (bufconn) and returns a CRI client on
// it: the same gRPC path as a unix socket without the file. stop closes the client and stops the server;
// ending ctx stops the server too. stop may be called more than once, and suits t.Cleanup.
func (r *Runtime) Dial(ctx context.Context) (client *cri.Client, stop func(), err error) {
	return r.DialWith(ctx, DialOptions{})
}

// DialOptions configures DialWith.
type DialOptions struct {
	// Client configures the CRI client (timeouts); its Endpoint is not used.
	Client cri.Config
	// BufferSize is the in-memory ring buffer of each direction of the connection, allocated when it
	// opens (default 1 MiB). Many runtimes in one process (imagefleet hollow) want it small: a write larger
	// than the buffer waits for the reader, nothing is lost.
	BufferSize int
}

// DialWith is Dial with options. The connection uses no file descriptor, so ten thousand runtimes in one
// process cost no more than their memory.
func (r *Runtime) DialWith(ctx context.Context, o DialOptions) (client *cri.Client, stop func(), err error) {
	lis := bufconn.Listen(cmp.Or(o.BufferSize, 1<<20))
	// No read buffer on either side: the framers read the in-memory pipe directly (there is no system
	// call to save), which spares 32 KiB a side per connection.
	stopServer := r.serveInBackground(ctx, lis, grpc.ReadBufferSize(0))
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)),
		// Share the idle connection's write buffer, as the server does.
		grpc.WithSharedWriteBuffer(true),
		grpc.WithReadBufferSize(0),
	)
	if err != nil {
		stopServer()
		return nil, nil, fmt.Errorf("dial hollow runtime %s: %w", r.name, err)
	}
	client = cri.NewFromConn(conn, o.Client)
	var once sync.Once
	return client, func() {
		once.Do(func() {
			_ = client.Close() // closing a client connection fails only if it is closed already
			stopServer()
		})
	}, nil
}
