package lab

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// probeOverlay checks that an overlay mount with its layers in dir works, copy-up and whiteouts included:
// what containerd's overlayfs snapshotter needs from the filesystem under it.
func probeOverlay(dir string) (err error) {
	p, err := os.MkdirTemp(dir, "overlay-probe-")
	if err != nil {
		return fmt.Errorf("probe overlay: %w", err)
	}
	defer os.RemoveAll(p)
	lower, upper, work, merged := filepath.Join(p, "l"), filepath.Join(p, "u"), filepath.Join(p, "w"), filepath.Join(p, "m")
	for _, d := range []string{lower, upper, work, merged} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return fmt.Errorf("probe overlay: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(lower, "f"), []byte("lower"), 0o600); err != nil {
		return fmt.Errorf("probe overlay: %w", err)
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := syscall.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		return fmt.Errorf("probe overlay: mount: %w", err)
	}
	defer func() {
		if uerr := syscall.Unmount(merged, syscall.MNT_DETACH); uerr != nil && err == nil {
			err = fmt.Errorf("probe overlay: unmount: %w", uerr)
		}
	}()
	if err := os.WriteFile(filepath.Join(merged, "f"), []byte("upper"), 0o600); err != nil {
		return fmt.Errorf("probe overlay: copy-up: %w", err)
	}
	if err := os.Remove(filepath.Join(merged, "f")); err != nil {
		return fmt.Errorf("probe overlay: whiteout: %w", err)
	}
	return nil
}

// RemovePods stops and removes every pod sandbox (and so every container) of the CRI runtime at endpoint,
// so their shims exit and their mounts go. "Already gone" counts as success.
//
// It speaks CRI itself because services/cri has no ListPodSandbox (imagefleet never lists pods through
// CRI); the lab is test infrastructure, not a second CRI client for the product.
func RemovePods(ctx context.Context, endpoint string) error {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("remove pods: dial %s: %w", endpoint, err)
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("remove pods: list pod sandboxes: %w", err)
	}
	var errs []error
	for _, sb := range list.Items {
		if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.Id}); err != nil && status.Code(err) != codes.NotFound {
			errs = append(errs, fmt.Errorf("remove pods: stop pod sandbox %s: %w", sb.Id, err))
			continue
		}
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil && status.Code(err) != codes.NotFound {
			errs = append(errs, fmt.Errorf("remove pods: remove pod sandbox %s: %w", sb.Id, err))
		}
	}
	return errors.Join(errs...)
}

// killLeftovers removes what a killed containerd leaves behind: runc containers (found in this containerd's
// own runc root) and their shims (found by the containerd address on their command line, so no other
// containerd's shims are touched), and the shims' sockets.
func killLeftovers(runcRoot, grpcSock string) error {
	var errs []error
	namespaces, _ := os.ReadDir(runcRoot)
	for _, ns := range namespaces {
		nsRoot := filepath.Join(runcRoot, ns.Name())
		out, err := exec.Command("runc", "--root", nsRoot, "list", "-q").Output()
		if err != nil {
			errs = append(errs, fmt.Errorf("list runc containers in %s: %w", nsRoot, err))
			continue
		}
		for _, id := range strings.Fields(string(out)) {
			if out, err := exec.Command("runc", "--root", nsRoot, "delete", "--force", id).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("delete runc container %s: %w: %s", id, err, strings.TrimSpace(string(out))))
			}
		}
	}
	shims := shimPIDs(grpcSock)
	for _, pid := range shims {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("kill shim %d: %w", pid, err))
		}
	}
	// The shims are not our children (they daemonize), so wait by watching /proc.
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range shims {
		for alive(pid) {
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("shim %d still alive 10s after SIGKILL", pid))
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// A killed shim leaves its socket in /run/containerd/s; its bundle says which.
	state := filepath.Join(filepath.Dir(grpcSock), "state", "io.containerd.runtime.v2.task")
	addrs, _ := filepath.Glob(filepath.Join(state, "*", "*", "address"))
	for _, f := range addrs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sock := strings.TrimPrefix(strings.TrimSpace(string(b)), "unix://")
		if strings.HasPrefix(sock, "/run/containerd/s/") {
			_ = os.Remove(sock) // a shim that exited cleanly removed it already
		}
	}
	return errors.Join(errs...)
}

// shimPIDs lists the containerd shims whose -address is grpcSock.
func shimPIDs(grpcSock string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		if i := slices.Index(args, "-address"); i >= 0 && i+1 < len(args) && args[i+1] == grpcSock {
			pids = append(pids, pid)
		}
	}
	return pids
}

// alive reports whether pid runs (a zombie has released its mounts and sockets: it counts as gone).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the parenthesized command name, which may itself hold spaces.
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}

// mountsUnder lists the mount points at or under dir, in mount order.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountinfo(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	return out, nil
}

// unescapeMountinfo undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// UnmountUnder unmounts everything at or under dir, newest first (a later mount may sit on an earlier one):
// umount, else a lazy umount of a busy one; it fails naming what is still mounted after five rounds.
func UnmountUnder(dir string) error {
	for attempt := 0; attempt < 5; attempt++ {
		mps, err := mountsUnder(dir)
		if err != nil {
			return err
		}
		if len(mps) == 0 {
			return nil
		}
		for _, mp := range slices.Backward(mps) {
			if err := syscall.Unmount(mp, 0); err != nil && !errors.Is(err, syscall.EINVAL) {
				// Busy (a process still has a file open there): detach now, the kernel frees it later.
				_ = syscall.Unmount(mp, syscall.MNT_DETACH)
			}
		}
	}
	mps, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if len(mps) > 0 {
		return fmt.Errorf("unmount under %s: still mounted: %s", dir, strings.Join(mps, ", "))
	}
	return nil
}
