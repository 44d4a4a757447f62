package kubelab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/integration/lab"
)

// KubeletRoot is the kubelet's --root-dir.
func (c *Cluster) KubeletRoot() string { return filepath.Join(c.dir, "kubelet") }

// PodsSocket is the kubelet's Pods API socket (KEP-4188): <root-dir>/pods-api/pods-api.sock.
func (c *Cluster) PodsSocket() string {
	return filepath.Join(c.KubeletRoot(), "pods-api", "pods-api.sock")
}

// StaticPodPath is the kubelet's staticPodPath: a manifest written there becomes a static pod with a mirror
// pod in the API.
func (c *Cluster) StaticPodPath() string { return filepath.Join(c.dir, "manifests") }

// KubeletLogTail returns the last n lines of the kubelet's log.
func (c *Cluster) KubeletLogTail(n int) string {
	if c.kubelet == nil {
		return "(no kubelet)"
	}
	return c.kubelet.logTail(n)
}

// cniStub answers ADD with an error (this lab has no pod network) and everything else with success, so the
// runtime reports NetworkReady and host-network pods run; installed as the conflist's plugin and as
// "loopback", which containerd's CRI always runs (without it a non-host-network pod can never be deleted).
const cniStub = `#!/bin/sh
case "$CNI_COMMAND" in
ADD) echo '{"cniVersion":"0.4.0","code":100,"msg":"this lab has no pod network: set hostNetwork: true"}'; exit 1 ;;
VERSION) echo '{"cniVersion":"0.4.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0"]}' ;;
*) cat >/dev/null ;;
esac
`

// writeCNI installs the stub; files are written by rename, as containerd reloads on the first inotify event.
func writeCNI(dir string) error {
	files := []struct {
		name string
		data string
		mode os.FileMode
	}{
		{"lab-hostnet-only", cniStub, 0o755},
		{"loopback", cniStub, 0o755},
		{"10-lab-hostnet-only.conflist", `{"cniVersion":"0.4.0","name":"lab-hostnet-only","plugins":[{"type":"lab-hostnet-only"}]}` + "\n", 0o644},
	}
	for _, f := range files {
		tmp := filepath.Join(dir, "."+f.name+".tmp")
		if err := os.WriteFile(tmp, []byte(f.data), f.mode); err != nil {
			return err
		}
		if err := os.Rename(tmp, filepath.Join(dir, f.name)); err != nil {
			return err
		}
	}
	return nil
}

// nodeIP is the machine's own IPv4 address: the kubelet refuses a loopback node IP. A UDP "connect" sends
// nothing; it only asks the kernel for the source address of the default route.
func nodeIP() (string, error) {
	if conn, err := net.Dial("udp4", "192.0.2.255:9"); err == nil {
		ip := conn.LocalAddr().(*net.UDPAddr).IP
		conn.Close()
		if !ip.IsLoopback() {
			return ip.String(), nil
		}
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "", err
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			return n.IP.String(), nil
		}
	}
	return "", errors.New("kubelab: no non-loopback IPv4 address for the kubelet's node IP")
}

// kubeletLock is held while a lab kubelet runs: two kubelets on one machine share the kubepods cgroups (each
// removes pod cgroups it does not know), /var/lib/kubelet/device-plugins/kubelet.sock and
// /var/log/containers, so test packages that run at once (go test -p) take turns.
const kubeletLock = "/tmp/ifl-kubelet.lock"

// lockKubelet waits (up to 15 minutes) for the machine's lab kubelet lock.
func (c *Cluster) lockKubelet(ctx context.Context) error {
	f, err := os.OpenFile(kubeletLock, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("kubelab: kubelet lock: %w", err)
	}
	deadline := time.Now().Add(15 * time.Minute)
	for waited := false; ; waited = true {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			c.lock = f
			return nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			return fmt.Errorf("kubelab: kubelet lock %s: %w", kubeletLock, err)
		}
		if !waited {
			c.logf("another lab kubelet runs on this machine; waiting for it to stop")
		}
		select {
		case <-ctx.Done():
			f.Close()
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (c *Cluster) startKubelet(ctx context.Context) error {
	if !c.opts.Detach {
		if err := c.lockKubelet(ctx); err != nil {
			return err
		}
	}
	ip, err := nodeIP()
	if err != nil {
		return err
	}
	c.NodeIP = ip
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	c.KubeletPort, c.KubeletHealthzPort = ports[0], ports[1]
	if err := writeCNI(c.opts.CNIDir); err != nil {
		return fmt.Errorf("kubelab: cni: %w", err)
	}
	run := c.dir
	for _, d := range []string{c.StaticPodPath(), filepath.Join(run, "pod-logs"), filepath.Join(run, "volume-plugins"), c.KubeletRoot()} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}
	// cgroup v1 without systemd (these machines): cgroupfs and failCgroupV1 false. A partial evictionHard
	// replaces all defaults; imagefs.available "0%" leaves disk pressure to image GC on the small tmpfs.
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: %s
staticPodPath: %s
podLogsDir: %s
volumePluginDir: %s
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "10%%"
  nodefs.inodesFree: "5%%"
  imagefs.available: "0%%"
  imagefs.inodesFree: "5%%"
%s`, c.opts.CRIEndpoint, c.StaticPodPath(), filepath.Join(run, "pod-logs"), filepath.Join(run, "volume-plugins"),
		ip, c.KubeletPort, c.KubeletHealthzPort, c.CAFile(), c.opts.KubeletConfig)
	cfgPath := c.KubeletConfigPath()
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	node := c.opts.Nodes[0]
	c.kubelet = &proc{name: "kubelet", bin: filepath.Join(c.bin, "kubelet"), dir: c.dir, detach: c.opts.Detach, args: []string{
		"--config=" + cfgPath, "--kubeconfig=" + c.KubeconfigPath(node), "--root-dir=" + c.KubeletRoot(),
		"--cert-dir=" + filepath.Join(c.KubeletRoot(), "pki"), "--hostname-override=" + node, "--node-ip=" + ip, "--v=2",
	}}
	if err := c.kubelet.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	return c.waitKubelet(ctx)
}

// KubeletConfigPath is the kubelet's configuration file (KubeletConfiguration).
func (c *Cluster) KubeletConfigPath() string { return filepath.Join(c.dir, "kubelet-config.yaml") }

// RestartKubelet stops the kubelet (SIGTERM, then SIGKILL after grace) and starts it again with the same
// flags, as a node's kubelet restarts: the pods go on running in the runtime. It returns once the node is
// Ready again with its Pods API socket.
func (c *Cluster) RestartKubelet(ctx context.Context, grace time.Duration) error {
	if c.kubelet == nil {
		return fmt.Errorf("kubelab: no kubelet in this lab (Options.CRIEndpoint)")
	}
	c.kubelet.stop(grace)
	if err := c.kubelet.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	return c.waitKubelet(ctx)
}

// waitKubelet waits for the kubelet's healthz, its Pods API socket and its Node Ready.
func (c *Cluster) waitKubelet(ctx context.Context) error {
	node := c.opts.Nodes[0]
	if err := c.waitHTTP(ctx, c.kubelet, fmt.Sprintf("http://127.0.0.1:%d/healthz", c.KubeletHealthzPort), nil, 60*time.Second); err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, serr := os.Stat(c.PodsSocket())
		n, nerr := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if serr == nil && nerr == nil && nodeReady(n.Status.Conditions) {
			return nil
		}
		if !c.kubelet.running() {
			return fmt.Errorf("kubelab: kubelet exited: %v\n%s", c.kubelet.waitErr, c.kubelet.logTail(30))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kubelab: node %s not Ready with a Pods API socket after 60s (socket: %v, node: %v)\n%s", node, serr, nerr, c.kubelet.logTail(30))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func nodeReady(conds []corev1.NodeCondition) bool {
	for _, c := range conds {
		if c.Type == "Ready" && c.Status == "True" {
			return true
		}
	}
	return false
}

// cleanKubelet removes what a stopped kubelet leaves outside its processes, in the order deploy/lab/README.md gives: the
// runtime's pods (through CRI, so nothing holds the volumes), every mount under the kubelet's root (deepest
// first, lazily if busy), the empty kubepods cgroups, the /var/log/containers links into the lab, and the
// device-plugin socket (a path the kubelet hard-codes).
func cleanKubelet(criEndpoint, root, labDir string) []error {
	var errs []error
	if criEndpoint != "" {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if err := lab.RemovePods(ctx, criEndpoint); err != nil && !strings.Contains(err.Error(), "connect") {
			errs = append(errs, fmt.Errorf("remove pods: %w", err))
		}
		cancel()
	}
	errs = append(errs, lab.UnmountUnder(root))
	CleanCgroups()
	errs = append(errs, CleanLinks(labDir))
	return errs
}

// CleanCgroups removes the kubelet's empty kubepods cgroups in every hierarchy (rmdir only: a cgroup that
// still holds a process stays).
func CleanCgroups() {
	tops, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	if fi, err := os.Stat("/sys/fs/cgroup/kubepods"); err == nil && fi.IsDir() {
		tops = append(tops, "/sys/fs/cgroup/kubepods")
	}
	for _, top := range tops {
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = syscall.Rmdir(dirs[i])
		}
	}
}

// CleanLinks removes the /var/log/containers links that point into labDir and the kubelet's device-plugin
// socket, then those directories if empty: the kubelet hard-codes both paths.
func CleanLinks(labDir string) error {
	ents, _ := os.ReadDir("/var/log/containers")
	for _, e := range ents {
		p := filepath.Join("/var/log/containers", e.Name())
		if target, err := os.Readlink(p); err == nil && strings.HasPrefix(target, labDir+"/") {
			_ = os.Remove(p)
		}
	}
	_ = os.Remove("/var/log/containers") // only when empty
	_ = os.Remove("/var/lib/kubelet/device-plugins/kubelet.sock")
	_ = os.Remove("/var/lib/kubelet/device-plugins")
	_ = os.Remove("/var/lib/kubelet")
	return nil
}
