package socket

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"slices"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/imagefleet/imagefleet/services/cri"
)

// Why a socket was not used. Every Attempt.Err wraps one, followed by what to do about it.
var (
	// ErrNotExist: nothing at the path.
	ErrNotExist = errors.New("does not exist")
	// ErrNotSocket: something other than a socket at the path.
	ErrNotSocket = errors.New("not a socket")
	// ErrPermission: the agent may not connect (file mode, a security module) or not reach the path.
	ErrPermission = errors.New("permission denied")
	// ErrRefused: a socket file with nothing listening on it.
	ErrRefused = errors.New("connection refused")
	// ErrNoAnswer: the connection or CRI's Version did not complete within the probe's timeout.
	ErrNoAnswer = errors.New("no answer")
	// ErrNotCRI: something answers, but not CRI v1's Version.
	ErrNotCRI = errors.New("not a CRI runtime")
)

// maxPath is the longest path a unix socket address holds on Linux: 108 bytes with the terminating NUL.
const maxPath = 107

// prober checks one socket.
type prober struct {
	timeout time.Duration
	dial    func(ctx context.Context, path string) (net.Conn, error)
}

// check stats path: a socket the agent can name, or why not.
func check(path string) (fs.FileInfo, error) {
	info, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
		return nil, ErrNotExist
	case errors.Is(err, fs.ErrPermission):
		return nil, fmt.Errorf("%w: a directory on the way does not let the agent (uid %d) through", ErrPermission, os.Geteuid())
	case err != nil:
		// The caller names the path: keep only the cause.
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("stat: %w", err)
	}
	if info.Mode().Type() != fs.ModeSocket {
		return nil, notSocket(info.Mode())
	}
	if len(path) > maxPath {
		return nil, fmt.Errorf("the path is %d bytes, longer than the %d a unix socket address holds: "+
			"mount the host's directory at a shorter root", len(path), maxPath)
	}
	return info, nil
}

func notSocket(m fs.FileMode) error {
	switch {
	case m.IsDir():
		// Both containerd's CRI and Docker create a bind mount's missing source as a directory: a hostPath
		// volume of the socket mounted while the runtime was down leaves this behind, and the runtime then
		// cannot create its socket there.
		return fmt.Errorf("%w but a directory: a pod that mounted the socket's path before the runtime created it leaves one; "+
			"remove it on the host, restart the runtime, and mount the directory that holds the socket", ErrNotSocket)
	case m.IsRegular():
		return fmt.Errorf("%w but a regular file", ErrNotSocket)
	}
	return fmt.Errorf("%w but %v", ErrNotSocket, m.Type())
}

// probe connects to the socket at path and asks CRI's Version. An error from a cancelled ctx is returned
// as it is: the caller stopped asking, and the socket did nothing wrong.
func (p *prober) probe(ctx context.Context, path string, info fs.FileInfo) (name, version string, err error) {
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	// A plain connect first: its errno says what is wrong with the socket, which gRPC would only report as
	// text inside Unavailable.
	conn, err := p.dial(ctx, path)
	if err != nil {
		if parent.Err() != nil {
			return "", "", parent.Err()
		}
		return "", "", p.dialErr(err, info)
	}
	_ = conn.Close()
	name, version, err = p.version(ctx, path)
	if err != nil {
		if parent.Err() != nil {
			return "", "", parent.Err()
		}
		return "", "", p.versionErr(err)
	}
	return name, version, nil
}

// version asks the runtime at path for CRI's Version through the CRI client, which maps gRPC's codes.
func (p *prober) version(ctx context.Context, path string) (name, version string, err error) {
	conn, err := grpc.NewClient("unix://"+path,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return p.dial(ctx, path) }),
		// gRPC gives up connecting after 20 s by default and then fails the call as Unavailable: a silent
		// socket probed for longer would read as "not gRPC" rather than "no answer". Past the probe's own
		// deadline, so that the deadline always comes first.
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.DefaultConfig, MinConnectTimeout: 2 * p.timeout}),
	)
	if err != nil {
		return "", "", err
	}
	c := cri.NewFromConn(conn, cri.Config{Timeout: p.timeout})
	defer func() { _ = c.Close() }()
	return c.Version(ctx)
}

func (p *prober) dialErr(err error, info fs.FileInfo) error {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ENOENT):
		return fmt.Errorf("%w (any more: removed while the agent looked)", ErrNotExist)
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		groups, _ := os.Getgroups()
		return fmt.Errorf("%w: %s", ErrPermission, permissionHint(info, os.Geteuid(), groups))
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("%w: nothing listens on it; the runtime is stopped, or this socket outlived it "+
			"(a socket mounted into a pod as a single file stays the old one when the runtime restarts: mount its directory)", ErrRefused)
	case errors.Is(err, syscall.EAGAIN):
		return fmt.Errorf("%w: its queue of pending connections is full; the runtime is not accepting them", ErrNoAnswer)
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return fmt.Errorf("%w in %v: connecting did not complete", ErrNoAnswer, p.timeout)
	}
	// The caller names the path, which the dial error repeats.
	var oe *net.OpError
	if errors.As(err, &oe) {
		return oe.Err
	}
	return err
}

func (p *prober) versionErr(err error) error {
	switch {
	case errors.Is(err, cri.ErrUnimplemented):
		return fmt.Errorf("%w: it speaks gRPC but does not serve CRI v1 "+
			"(a containerd with its cri plugin disabled, as Docker's own; the kubelet's runtime listens elsewhere)", ErrNotCRI)
	case errors.Is(err, cri.ErrTimeout):
		return fmt.Errorf("%w in %v: it accepted the connection but did not answer CRI Version (the runtime is hung or overloaded, "+
			"or no gRPC server listens there)", ErrNoAnswer, p.timeout)
	case errors.Is(err, cri.ErrUnavailable):
		return fmt.Errorf("%w: it accepted the connection but does not speak gRPC (%s)", ErrNotCRI, cri.RuntimeMessage(err))
	}
	return fmt.Errorf("%w: CRI Version failed: %v", ErrNotCRI, err)
}

// permissionHint says why the agent, running as euid in groups, may not connect to the socket info
// describes, and what to change. Connecting to a unix socket needs write permission on it.
func permissionHint(info fs.FileInfo, euid int, groups []int) string {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return "the agent must run as root or in the socket's group"
	}
	mode := info.Mode()
	sock := fmt.Sprintf("the socket is %v uid %d gid %d", mode, st.Uid, st.Gid)
	lsm := "a security module refuses it (SELinux: give the pod a type allowed to connect, such as spc_t; AppArmor: its profile)"
	switch {
	case euid == 0 && st.Uid == 0 && mode&0o200 != 0,
		euid != 0 && uint32(euid) == st.Uid && mode&0o200 != 0,
		euid != 0 && slices.Contains(groups, int(st.Gid)) && mode&0o020 != 0,
		mode&0o002 != 0:
		// The mode lets the agent in.
		return fmt.Sprintf("%s and lets the agent (uid %d) connect, so %s", sock, euid, lsm)
	case euid == 0:
		return fmt.Sprintf("%s and the agent runs as root without CAP_DAC_OVERRIDE (a pod that drops ALL capabilities): "+
			"give it that capability, or make root the socket's owner; otherwise %s", sock, lsm)
	}
	if mode&0o020 == 0 {
		return fmt.Sprintf("%s and the agent runs as uid %d: run it as root (the socket's group may not write to it)", sock, euid)
	}
	return fmt.Sprintf("%s and the agent runs as uid %d: run it as root, or in group %d (a pod's supplementalGroups)",
		sock, euid, st.Gid)
}
