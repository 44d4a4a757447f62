package integration_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
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
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
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
	metrics  int    // the agent's metrics port (host network)
	valueArg []string
}

// upgradeFrom is the earlier commit whose chart and image the test installs first and upgrades from: the
// first one whose chart installs on the lab.
const upgradeFrom = "1646710"

// buildImage builds the image of revision for this machine's platform with cmd/imagefleet-image and pushes it
// to the lab's registry as imagefleet:tag.
func (l *installLab) buildImage(revision, tag string) {
	t0 := time.Now()
	build := exec.CommandContext(l.t.Context(), "go", "run", "./cmd/imagefleet-image", "--image", l.reg.Ref("imagefleet:"+tag),
		"--platforms", "linux/amd64", "--revision", revision)
	build.Dir = ".."
	out, err := build.CombinedOutput()
	if err != nil {
		l.t.Fatalf("building the image of %s: %v\n%s", revision, err, out)
	}
	l.t.Logf("image of %s built and pushed in %s", revision, time.Since(t0).Round(time.Second))
}

// chartAt writes the chart of revision into a directory of the test and returns it.
func (l *installLab) chartAt(revision string) string {
	dir := filepath.Join(l.dir, "chart-"+revision)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		l.t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "git archive "+revision+" deploy/helm/imagefleet | tar -x -C "+dir)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		l.t.Fatalf("the chart of %s: %v\n%s", revision, err, out)
	}
	return filepath.Join(dir, "deploy/helm/imagefleet")
}

// agentUsage reads the agent's resident memory (MiB) and CPU seconds from its metrics endpoint.
func (l *installLab) agentUsage() (rssMiB, cpuSeconds float64) {
	resp, err := http.Get("http://127.0.0.1:" + strconv.Itoa(l.metrics) + "/metrics")
	if err != nil {
		l.t.Fatalf("the agent's metrics: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "process_resident_memory_bytes":
			rssMiB = v / (1 << 20)
		case "process_cpu_seconds_total":
			cpuSeconds = v
		}
	}
	if rssMiB == 0 {
		l.t.Fatalf("the agent's metrics have no process_resident_memory_bytes:\n%.2000s", body)
	}
	return rssMiB, cpuSeconds
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

// waitInstall waits until cond holds or timeout passes, then fails with its last word.
func waitInstall(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	bustest.Eventually(t, what, timeout, func() error {
		if ok, last := cond(); !ok {
			return errors.New(last)
		}
		return nil
	})
}

// podsReady reports whether every pod of the namespace but the Jobs' is Ready, and says which is not.
func podsReady(ctx context.Context, admin *kubernetes.Clientset) (bool, string) {
	pods, err := admin.CoreV1().Pods(installNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, err.Error()
	}
	var notReady []string
	for _, p := range pods.Items {
		// A Job's pod: its Job's completion is checked on its own (the pod's phase may still say Running for
		// a moment after its container completed).
		if p.Status.Phase == corev1.PodSucceeded || slices.ContainsFunc(p.OwnerReferences, func(o metav1.OwnerReference) bool { return o.Kind == "Job" }) {
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

// startInstallLab starts the registry, containerd, the kube lab with its controllers and the kubelet, and
// builds the images of upgradeFrom (imagefleet:old) and of the current commit (imagefleet:test) for this
// machine's platform with cmd/imagefleet-image into the lab's registry.
func startInstallLab(t *testing.T) *installLab {
	ctx := t.Context()
	l := &installLab{t: t, dir: t.TempDir()}
	l.reg = lab.StartRegistry(t, lab.RegistryOptions{})
	for _, ref := range []string{"lab/pause:1", "lab/app:1", "lab/extra:1", "lab/keep:1", "lab/slow:1", "lab/warm:1"} {
		lab.PushBusybox(t, l.reg.Host(), ref, lab.WithLabel("ref", ref))
	}
	l.ctr = lab.StartContainerd(t, lab.Options{SandboxImage: l.reg.Ref("lab/pause:1"), TmpfsSize: "768m"})
	l.c = kubelab.StartWithKubelet(t, l.ctr, kubelab.Options{Controllers: true})
	var err error
	if l.admin, err = l.c.Admin(); err != nil {
		t.Fatal(err)
	}
	l.buildImage(upgradeFrom, "old")
	l.buildImage("HEAD", "test")
	// The JetStream store on a PersistentVolumeClaim, as by default: a local volume on node-1 (the lab has no
	// provisioner). With an emptyDir, the NATS pod's restart at the upgrade would lose the streams.
	if _, err := l.c.AddLocalVolumes(ctx, 1, "1Gi"); err != nil {
		t.Fatal(err)
	}
	l.bin = imagefleetBinary(t)
	l.dataDir = filepath.Join(l.c.Dir(), "imagefleet-agent")
	port := func() int { return testport.Free(t) }
	client := port()
	l.metrics = port()
	l.natsURL = "tls://127.0.0.1:" + strconv.Itoa(client)
	values := fmt.Sprintf(`image: {repository: %s/imagefleet, tag: test, pullPolicy: IfNotPresent}
kubernetesAPI: {host: 127.0.0.1, port: %d}
nats:
  url: %s
  ports: {client: %d, cluster: %d, monitor: %d}
  persistence: {enabled: true, size: 1Gi, storageClass: lab-local}
agent:
  cri: %s
  dataDir: %s
  kubelet: {rootDir: %s, configFile: %s}
  metricsPort: %d
central:
  metricsPort: %d
`, l.reg.Host(), l.c.APIServerPort, l.natsURL, client, port(), port(), l.ctr.Endpoint(), l.dataDir,
		l.c.KubeletRoot(), l.c.KubeletConfigPath(), l.metrics, port())
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

// waitJobSucceeded waits until the Job's status counts its pod's success, failing at once if it counts a
// failure. `helm install --wait` returns once the pods are Ready, which does not wait for a Job: its pod can
// have completed while the job controller has not yet recorded it (CI saw Succeeded 0 with the pod done).
func (l *installLab) waitJobSucceeded(ctx context.Context, name string) {
	l.t.Helper()
	waitInstall(l.t, time.Minute, "Job "+name+" succeeded", func() (bool, string) {
		job, err := l.admin.BatchV1().Jobs(installNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if job.Status.Failed > 0 {
			l.t.Fatalf("Job %s failed: %+v", name, job.Status)
		}
		return job.Status.Succeeded == 1, fmt.Sprintf("%+v", job.Status)
	})
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
// promises: the chart and image of an earlier commit install with every pod Ready and upgrade to the
// current ones while a pull is in flight, which completes once; the agent holds node-1's identity with no
// seed on the host, and the auth callout refuses every token it must; a pull and a GC work through the
// installed system, with the pull's Events in the API; the agent recovers after containerd and the kubelet
// restart; and an uninstall leaves no pod and the node's other images.
func TestInstallOnTheKubeLab(t *testing.T) {
	ctx := t.Context()
	l := startInstallLab(t)

	// 1. Install the chart and image of an earlier commit, waiting for every pod and the init Job.
	t0 := time.Now()
	old := l.chartAt(upgradeFrom)
	out, err := l.helm(ctx, append([]string{"install", "imagefleet", old, "-n", installNS, "--create-namespace",
		"--wait", "--timeout", "6m"}, append(l.valueArg, "--set", "image.tag=old")...)...)
	if err != nil {
		t.Fatalf("helm install of %s: %v\n%s", upgradeFrom, err, out)
	}
	installTook := time.Since(t0)
	if ok, why := podsReady(ctx, l.admin); !ok {
		t.Fatalf("helm install --wait returned with pods not Ready: %s", why)
	}
	t.Logf("helm install to every pod Ready: %s", installTook.Round(100*time.Millisecond))
	l.waitJobSucceeded(ctx, "imagefleet-bus-init-r1")

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
	waitInstall(t, time.Minute, "node-1 Ready in `fleet nodes`", func() (bool, string) {
		out, err := l.cli(ctx, "fleet", "nodes", "-o", "json")
		if err != nil {
			return false, fmt.Sprintf("%v: %s", err, out)
		}
		return strings.Contains(out, `"node-1"`) && strings.Contains(out, "Ready"), out
	})

	// 3. Upgrade to this commit's chart and image while a pull is in flight: it completes once.
	l.reg.SetDelay(2 * time.Second)
	if out, err := l.cli(ctx, "pull", "--node", "node-1", "--policy", "Always", "--request-id", "upgrade-pull",
		l.reg.Ref("lab/slow:1")); err != nil {
		t.Fatalf("queueing the pull: %v\n%s", err, out)
	}
	waitInstall(t, 30*time.Second, "the pull reading from the registry", func() (bool, string) {
		st := l.reg.Stats()
		return st.InFlight > 0, fmt.Sprintf("%+v", st)
	})
	t0 = time.Now()
	out, err = l.helm(ctx, append([]string{"upgrade", "imagefleet", "deploy/helm/imagefleet", "-n", installNS,
		"--wait", "--timeout", "6m"}, l.valueArg...)...)
	if err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}
	l.reg.SetDelay(0)
	t.Logf("helm upgrade from %s to every pod Ready: %s", upgradeFrom, time.Since(t0).Round(100*time.Millisecond))
	l.waitJobSucceeded(ctx, "imagefleet-bus-init-r2")
	ds, err := l.admin.AppsV1().DaemonSets(installNS).Get(ctx, "imagefleet-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if img := ds.Spec.Template.Spec.Containers[0].Image; !strings.HasSuffix(img, "/imagefleet:test") {
		t.Fatalf("the agent's image after the upgrade: %s", img)
	}
	waitInstall(t, 2*time.Minute, "the pull queued before the upgrade pulled", func() (bool, string) {
		return present(t, l, "lab/slow:1"), "not in the runtime"
	})
	waitInstall(t, 30*time.Second, "its one pull.pulled event", func() (bool, string) {
		out, err := l.cli(ctx, "events", "--node", "node-1", "--type", "pull.pulled", "-o", "json")
		if err != nil {
			return false, fmt.Sprintf("%v: %s", err, out)
		}
		n := strings.Count(out, `"upgrade-pull"`)
		if n > 1 {
			t.Fatalf("the pull queued before the upgrade was pulled %d times:\n%s", n, out)
		}
		return n == 1, fmt.Sprintf("%d pulled events for it", n)
	})

	// 4. node-1's agent reports as node-1 with no seed on the host; the callout refuses what it must.
	if seeds, _ := filepath.Glob(filepath.Join(l.dataDir, "*.nk")); len(seeds) > 0 {
		t.Errorf("nkey seeds on the host: %v", seeds)
	}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil && strings.Contains(v.HostPath.Path, "nkey") {
			t.Errorf("the agent mounts %s from the host", v.HostPath.Path)
		}
	}
	installRefusals(t, l)
	rss, cpu := l.agentUsage()
	t.Logf("agent at rest: %.0f MiB resident, %.2f CPU seconds since its start", rss, cpu)

	// 5. A pull for a pod of node-1, and a GC, through the installed system.
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
	rss2, cpu2 := l.agentUsage()
	t.Logf("agent after a pull and a GC: %.0f MiB resident, %.2f CPU seconds more", rss2, cpu2-cpu)

	// 5b. An ImagePrePull with only its images, run by the central Deployment's controller under the chart's
	// RBAC: Complete on node-1, the image in the runtime.
	kcl := controllerClient(t, l.c.AdminConfig())
	ipp := &v1alpha1.ImagePrePull{ObjectMeta: metav1.ObjectMeta{Name: "warm"}, Spec: v1alpha1.ImagePrePullSpec{Images: []string{l.reg.Ref("lab/warm:1")}}}
	if err := kcl.Create(ctx, ipp); err != nil {
		t.Fatal(err)
	}
	if st := waitCondition(t, kcl, ipp, v1alpha1.ConditionComplete); st.Succeeded != 1 || st.Desired != 1 {
		t.Errorf("ImagePrePull warm: %+v", st)
	}
	if !present(t, l, "lab/warm:1") {
		t.Error("lab/warm:1 is not in the runtime after the ImagePrePull completed")
	}

	// 6. containerd, then the kubelet, restart: the agent answers again and a pull works.
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

	// 7. Uninstall: no imagefleet pod is left, the node's other images stay.
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
	if _, err := l.admin.CoreV1().PersistentVolumeClaims(installNS).Get(ctx, "data-imagefleet-nats-0", metav1.GetOptions{}); err != nil {
		t.Errorf("the NATS volume data-imagefleet-nats-0, which docs/install.md says stays: %v", err)
	}
	if _, err := l.admin.CoreV1().Secrets(installNS).Get(ctx, "imagefleet-nats-keys", metav1.GetOptions{}); err != nil {
		t.Errorf("the Secret imagefleet-nats-keys, which docs/install.md says stays: %v", err)
	}
	if err := kcl.Get(ctx, client.ObjectKeyFromObject(ipp), ipp); err != nil {
		t.Errorf("the ImagePrePull warm, which docs/install.md says stays with its CRD: %v", err)
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
