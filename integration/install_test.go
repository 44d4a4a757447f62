package integration_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// installNS is the namespace the chart is installed into, as docs/install.md does.
const installNS = "imagefleet"

// installLab is the kube lab with the chart installed: the API server, the node's containerd and registry,
// the operator's identity and a CLI to use it.
type installLab struct {
	t        *testing.T
	c        *kubelab.Cluster
	ctr      *lab.Containerd
	reg      *lab.Registry
	admin    *kubernetes.Clientset
	dir      string // the test's files: values, token, CA
	natsURL  string
	caFile   string
	tokFile  string // the operator's token (imagefleet-operator, audience imagefleet-nats)
	bin      string // the imagefleet CLI
	dataDir  string // the agent's state directory on the host
	valueArg []string
}

// helm runs `go tool helm` against the lab's API server, as docs/install.md does, and returns its output.
func (l *installLab) helm(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", append([]string{"tool", "helm", "--kubeconfig", l.c.KubeconfigPath("admin")}, args...)...)
	cmd.Dir = ".."
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// cli runs the imagefleet CLI as the operator (its token from TokenRequest, the chart's CA).
func (l *installLab) cli(ctx context.Context, args ...string) (string, error) {
	base := []string{"--nats", l.natsURL, "--tls-ca", l.caFile, "--token-file", l.tokFile, "--timeout", "20s"}
	out, err := exec.CommandContext(ctx, l.bin, append(base, args...)...).CombinedOutput()
	return string(out), err
}

// token asks the API server for a token of sa with audience, bound to pod when pod is set.
func (l *installLab) token(ctx context.Context, sa, audience string, pod *corev1.Pod) (string, error) {
	exp := int64(3600)
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{Audiences: []string{audience}, ExpirationSeconds: &exp}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	res, err := l.admin.CoreV1().ServiceAccounts(installNS).CreateToken(ctx, sa, req, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return res.Status.Token, nil
}

// connect connects to the installed NATS with token, as a pod would.
func (l *installLab) connect(ctx context.Context, name, token string) (*bus.Bus, error) {
	f := filepath.Join(l.dir, name+".token")
	if err := os.WriteFile(f, []byte(token), 0o600); err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	return bus.Connect(cctx, l.natsURL, bus.Options{Name: name, TokenFile: f, TLSCA: l.caFile})
}

// waitInstall polls cond every 250 ms until it holds or timeout passes, then fails with its last word.
func waitInstall(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s: %s", what, timeout, last)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// podsReady reports whether every pod of the namespace is Ready (or a completed Job's), and says which not.
func podsReady(ctx context.Context, admin *kubernetes.Clientset) (bool, string) {
	pods, err := admin.CoreV1().Pods(installNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, err.Error()
	}
	var notReady []string
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodSucceeded {
			continue
		}
		ready := false
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				ready = true
			}
		}
		if !ready {
			notReady = append(notReady, p.Name+" ("+string(p.Status.Phase)+")")
		}
	}
	if len(pods.Items) == 0 {
		return false, "no pods"
	}
	return len(notReady) == 0, "not Ready: " + strings.Join(notReady, ", ")
}

// startInstallLab starts the registry, containerd, the kube lab with its controllers and the kubelet, builds
// the image of the current commit for this machine's platform with cmd/imagefleet-image and pushes it to the
// lab's registry.
func startInstallLab(t *testing.T) *installLab {
	ctx := t.Context()
	l := &installLab{t: t, dir: t.TempDir()}
	l.reg = lab.StartRegistry(t, lab.RegistryOptions{})
	for _, ref := range []string{"lab/pause:1", "lab/app:1", "lab/extra:1", "lab/keep:1"} {
		lab.PushBusybox(t, l.reg.Host(), ref, lab.WithLabel("ref", ref))
	}
	l.ctr = lab.StartContainerd(t, lab.Options{SandboxImage: l.reg.Ref("lab/pause:1"), TmpfsSize: "768m"})
	l.c = kubelab.StartWithKubelet(t, l.ctr, kubelab.Options{Controllers: true})
	var err error
	if l.admin, err = l.c.Admin(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	build := exec.CommandContext(ctx, "go", "run", "./cmd/imagefleet-image", "--image", l.reg.Ref("imagefleet:test"),
		"--platforms", "linux/amd64", "--revision", "HEAD")
	build.Dir = ".."
	out, err := build.CombinedOutput()
	if err != nil {
		t.Fatalf("building the image: %v\n%s", err, out)
	}
	t.Logf("image of HEAD built and pushed in %s: %s", time.Since(t0).Round(time.Second), strings.TrimSpace(string(out)))
	l.bin = imagefleetBinary(t)
	l.dataDir = filepath.Join(l.c.Dir(), "imagefleet-agent")
	port := func() int { return testport.Free(t) }
	client := port()
	l.natsURL = "tls://127.0.0.1:" + strconv.Itoa(client)
	values := fmt.Sprintf(`image: {repository: %s/imagefleet, tag: test, pullPolicy: IfNotPresent}
kubernetesAPI: {host: 127.0.0.1, port: %d}
nats:
  url: %s
  ports: {client: %d, cluster: %d, monitor: %d}
agent:
  cri: %s
  dataDir: %s
  kubelet: {rootDir: %s, configFile: %s}
  metricsPort: %d
central:
  metricsPort: %d
`, l.reg.Host(), l.c.APIServerPort, l.natsURL, client, port(), port(), l.ctr.Endpoint(), l.dataDir,
		l.c.KubeletRoot(), l.c.KubeletConfigPath(), port(), port())
	vf := filepath.Join(l.dir, "values.yaml")
	if err := os.WriteFile(vf, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	l.valueArg = []string{"-f", "deploy/helm/imagefleet/values-lab.yaml", "-f", vf}
	t.Cleanup(func() {
		if t.Failed() {
			l.dumpPods()
		}
	})
	return l
}

// dumpPods logs each pod's state and the last lines of its containers' logs, for a failed test.
func (l *installLab) dumpPods() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pods, err := l.admin.CoreV1().Pods(installNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		l.t.Logf("pods: %v", err)
		return
	}
	for _, p := range pods.Items {
		l.t.Logf("pod %s: %s %+v", p.Name, p.Status.Phase, p.Status.ContainerStatuses)
		for _, c := range p.Spec.Containers {
			tail := int64(30)
			raw, err := l.admin.CoreV1().Pods(installNS).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, TailLines: &tail}).DoRaw(ctx)
			if err != nil {
				// No kubelet server certificate the API server trusts in the lab: read the log file itself.
				raw = []byte(err.Error())
				if files, _ := filepath.Glob(filepath.Join(l.c.Dir(), "pod-logs", installNS+"_"+p.Name+"_*", c.Name, "*.log")); len(files) > 0 {
					if b, rerr := os.ReadFile(files[len(files)-1]); rerr == nil {
						lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
						raw = []byte(strings.Join(lines[max(0, len(lines)-30):], "\n"))
					}
				}
			}
			l.t.Logf("--- %s/%s:\n%s", p.Name, c.Name, raw)
		}
	}
}

// TestInstallOnTheKubeLab installs the chart with real helm on a real control plane (etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, a kubelet on containerd) and checks what docs/install.md
// promises: every pod Ready; the agent holding node-1's identity with no seed on the host, and every
// refusal of the auth callout; a pull and a GC through the installed system, with the pull's Events in
// the API; recovery after containerd and the kubelet restart; and an uninstall that leaves no pod and the
// node's other images.
func TestInstallOnTheKubeLab(t *testing.T) {
	ctx := t.Context()
	l := startInstallLab(t)

	// 1. Install, waiting for every pod and the init Job.
	t0 := time.Now()
	out, err := l.helm(ctx, append([]string{"install", "imagefleet", "deploy/helm/imagefleet", "-n", installNS, "--create-namespace",
		"--wait", "--timeout", "6m"}, l.valueArg...)...)
	if err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	installTook := time.Since(t0)
	if ok, why := podsReady(ctx, l.admin); !ok {
		t.Fatalf("helm install --wait returned with pods not Ready: %s", why)
	}
	t.Logf("helm install to every pod Ready: %s", installTook.Round(100*time.Millisecond))
	jobs, err := l.admin.BatchV1().Jobs(installNS).Get(ctx, "imagefleet-bus-init-r1", metav1.GetOptions{})
	if err != nil || jobs.Status.Succeeded != 1 {
		t.Fatalf("the init Job: %v, status %+v", err, jobs.Status)
	}

	// 2. The operator's identity: a token of imagefleet-operator, the CA from the chart's Secret.
	tlsSecret, err := l.admin.CoreV1().Secrets(installNS).Get(ctx, "imagefleet-nats-tls", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l.caFile = filepath.Join(l.dir, "ca.crt")
	if err := os.WriteFile(l.caFile, tlsSecret.Data["ca.crt"], 0o644); err != nil {
		t.Fatal(err)
	}
	opTok, err := l.token(ctx, "imagefleet-operator", "imagefleet-nats", nil)
	if err != nil {
		t.Fatal(err)
	}
	l.tokFile = filepath.Join(l.dir, "operator.token")
	if err := os.WriteFile(l.tokFile, []byte(opTok), 0o600); err != nil {
		t.Fatal(err)
	}

	// 3. node-1's agent reports as node-1 with no seed on the host.
	waitInstall(t, time.Minute, "node-1 Ready in `fleet nodes`", func() (bool, string) {
		out, err := l.cli(ctx, "fleet", "nodes", "-o", "json")
		if err != nil {
			return false, fmt.Sprintf("%v: %s", err, out)
		}
		return strings.Contains(out, `"node-1"`) && strings.Contains(out, "Ready"), out
	})
	if seeds, _ := filepath.Glob(filepath.Join(l.dataDir, "*.nk")); len(seeds) > 0 {
		t.Errorf("nkey seeds on the host: %v", seeds)
	}
	ds, err := l.admin.AppsV1().DaemonSets(installNS).Get(ctx, "imagefleet-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil && strings.Contains(v.HostPath.Path, "nkey") {
			t.Errorf("the agent mounts %s from the host", v.HostPath.Path)
		}
	}
	installRefusals(t, l)

	// 4. A pull for a pod of node-1, and a GC, through the installed system.
	pod := labPod(t, l, "app", l.reg.Ref("lab/app:1"), "default")
	out, err = l.cli(ctx, "pull", "--node", "node-1", "--pod", installNS+"/"+pod.Name+"/"+string(pod.UID), "--policy", "Always",
		"--wait", "--wait-timeout", "2m", l.reg.Ref("lab/extra:1"))
	if err != nil {
		t.Fatalf("pull through the installed system: %v\n%s", err, out)
	}
	waitInstall(t, time.Minute, "the pull's Pulling and Pulled Events on the pod", func() (bool, string) {
		evs, err := l.admin.CoreV1().Events(installNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(pod.UID)})
		if err != nil {
			return false, err.Error()
		}
		var reasons []string
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "lab/extra:1") {
				reasons = append(reasons, e.Reason)
			}
		}
		return slices.Contains(reasons, "Pulling") && slices.Contains(reasons, "Pulled"), fmt.Sprintf("reasons %v", reasons)
	})
	out, err = l.cli(ctx, "gc", "--node", "node-1", "--all-unused", "--minimum-image-ttl-duration", "0s", "-o", "json")
	if err != nil {
		t.Fatalf("gc through the installed system: %v\n%s", err, out)
	}
	if !strings.Contains(out, "lab/extra:1") {
		t.Errorf("gc --all-unused did not remove the unused lab/extra:1:\n%s", out)
	}
	if present(t, l, "lab/extra:1") {
		t.Error("lab/extra:1 is still in the runtime after the GC")
	}
	if !present(t, l, "lab/app:1") {
		t.Error("the GC removed lab/app:1, which a running pod uses")
	}

	// 5. containerd, then the kubelet, restart: the agent answers again and a pull works.
	l.ctr.Restart()
	if err := l.c.RestartKubelet(ctx, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	waitInstall(t, 2*time.Minute, "every pod Ready after containerd and the kubelet restarted", func() (bool, string) {
		return podsReady(ctx, l.admin)
	})
	waitInstall(t, 2*time.Minute, "a pull after the restarts", func() (bool, string) {
		out, err := l.cli(ctx, "pull", "--node", "node-1", "--policy", "Always", "--wait", "--wait-timeout", "30s", l.reg.Ref("lab/extra:1"))
		return err == nil, fmt.Sprintf("%v: %s", err, out)
	})
	if !present(t, l, "lab/extra:1") {
		t.Error("lab/extra:1 is not in the runtime after the pull that followed the restarts")
	}

	// 6. Uninstall: no imagefleet pod is left, the node's other images stay.
	if out, err := l.cli(ctx, "pull", "--node", "node-1", "--wait", "--wait-timeout", "1m", l.reg.Ref("lab/keep:1")); err != nil {
		t.Fatalf("pull: %v\n%s", err, out)
	}
	before := imageRefs(t, l)
	if !slices.Contains(before, l.reg.Ref("lab/keep:1")) {
		t.Fatalf("lab/keep:1 not in the runtime after its pull: %v", before)
	}
	t0 = time.Now()
	if out, err := l.helm(ctx, "uninstall", "imagefleet", "-n", installNS, "--wait", "--timeout", "3m"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	waitInstall(t, 2*time.Minute, "no imagefleet pod left", func() (bool, string) {
		pods, err := l.admin.CoreV1().Pods(installNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=imagefleet"})
		if err != nil {
			return false, err.Error()
		}
		var left []string
		for _, p := range pods.Items {
			left = append(left, p.Name)
		}
		return len(left) == 0, fmt.Sprintf("left: %v", left)
	})
	t.Logf("helm uninstall to no imagefleet pod: %s", time.Since(t0).Round(100*time.Millisecond))
	after := imageRefs(t, l)
	for _, ref := range before {
		if strings.Contains(ref, "/imagefleet:") {
			continue // the chart's own image: the kubelet's GC decides when it goes
		}
		if !slices.Contains(after, ref) {
			t.Errorf("uninstall removed %s from the node", ref)
		}
	}
	if _, err := l.admin.CoreV1().Secrets(installNS).Get(ctx, "imagefleet-nats-keys", metav1.GetOptions{}); err != nil {
		t.Errorf("the Secret imagefleet-nats-keys, which docs/install.md says stays: %v", err)
	}
	if _, err := os.Stat(filepath.Join(l.dataDir, "journal")); err != nil {
		t.Errorf("the agent's state directory, which docs/install.md says stays on the host: %v", err)
	}
}

// installRefusals tries each token the auth callout must refuse against the installed NATS, beside the
// token it must accept, so a refusal cannot pass by every connect failing.
func installRefusals(t *testing.T, l *installLab) {
	ctx := t.Context()
	probe := labPod(t, l, "probe", l.reg.Ref("lab/app:1"), "imagefleet-agent")
	agentTok, err := l.token(ctx, "imagefleet-agent", "imagefleet-nats", probe)
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.connect(ctx, "node-1-probe", agentTok)
	if err != nil {
		t.Fatalf("an agent token bound to a pod on node-1 was refused: %v", err)
	}
	own := events.EventSubject("node-1", "image", "probe")
	other := events.EventSubject("node-2", "image", "added")
	if err := b.PublishRaw(other, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	waitInstall(t, 10*time.Second, "node-1's token publishing on node-2's subject refused", func() (bool, string) {
		err := b.PermissionViolation(other)
		return errors.Is(err, bus.ErrPermissionViolation), fmt.Sprint(err)
	})
	if err := b.PermissionViolation(own); err != nil {
		t.Errorf("node-1's own subject refused: %v", err)
	}
	b.Close()

	refused := func(what, token string) {
		t.Helper()
		if b, err := l.connect(ctx, "refused", token); err == nil {
			b.Close()
			t.Errorf("%s: connected, want refused", what)
		} else {
			t.Logf("%s: refused: %v", what, err)
		}
	}
	other1, err := l.token(ctx, "default", "imagefleet-nats", nil)
	if err != nil {
		t.Fatal(err)
	}
	refused("a token of another ServiceAccount", other1)
	wrongAud, err := l.token(ctx, "imagefleet-operator", "other", nil)
	if err != nil {
		t.Fatal(err)
	}
	refused("a token of another audience", wrongAud)
	unbound, err := l.token(ctx, "imagefleet-agent", "imagefleet-nats", nil)
	if err != nil {
		t.Fatal(err)
	}
	refused("an agent token bound to no pod", unbound)
	if err := l.admin.CoreV1().Pods(installNS).Delete(ctx, probe.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	waitInstall(t, time.Minute, "the probe pod deleted", func() (bool, string) {
		_, err := l.admin.CoreV1().Pods(installNS).Get(ctx, probe.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	// The API server keeps a token review's success for 10 s (its authentication cache): a deleted pod's
	// token is refused once that has passed, not at the deletion.
	deleted := time.Now()
	waitInstall(t, time.Minute, "the token of a deleted pod refused", func() (bool, string) {
		b, err := l.connect(ctx, "deleted-pod", agentTok)
		if err == nil {
			b.Close()
			return false, "connected"
		}
		return true, ""
	})
	t.Logf("the token of a deleted pod: refused %s after the deletion", time.Since(deleted).Round(100*time.Millisecond))
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if b, err := bus.Connect(cctx, l.natsURL, bus.Options{Name: "no-token", TLSCA: l.caFile}); err == nil {
		b.Close()
		t.Error("a connection with no token: connected, want refused")
	} else {
		t.Logf("no token: refused: %v", err)
	}
}

// labPod creates a pod of busybox sleeping on node-1 in the install namespace, running as sa, and waits for
// it to run.
func labPod(t *testing.T, l *installLab, name, image, sa string) *corev1.Pod {
	ctx := t.Context()
	p, err := l.admin.CoreV1().Pods(installNS).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			NodeName: "node-1", ServiceAccountName: sa, HostNetwork: true, AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "main", Image: image, Command: []string{"/bin/busybox", "sleep", "3600"}}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitInstall(t, time.Minute, "pod "+name+" Running", func() (bool, string) {
		got, err := l.admin.CoreV1().Pods(installNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		p = got
		return got.Status.Phase == corev1.PodRunning, string(got.Status.Phase)
	})
	return p
}

// imageRefs lists the repo tags in the node's runtime.
func imageRefs(t *testing.T, l *installLab) []string {
	imgs, err := l.ctr.Client().ListImages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, img := range imgs {
		refs = append(refs, img.RepoTags...)
	}
	slices.Sort(refs)
	return refs
}

// present reports whether the runtime holds an image tagged with the lab registry's repoTag.
func present(t *testing.T, l *installLab, repoTag string) bool {
	return slices.Contains(imageRefs(t, l), l.reg.Ref(repoTag))
}
