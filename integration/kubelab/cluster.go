package kubelab

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// DirPrefix starts the name of every directory Start creates under /tmp. .ci/run removes what a killed run
// left under /tmp/ifl-k-* (processes, kubelet mounts, the directory).
const DirPrefix = "ifl-k-"

// Options configures a lab cluster.
type Options struct {
	// Dir holds everything of the cluster (PKI, etcd data, logs, kubeconfigs, the kubelet's root). Default: a
	// new /tmp/ifl-k-XXXX. Keep it short: the kubelet's Pods API socket lives under it (108-byte limit).
	Dir string
	// BinDir holds the binaries (Binaries). Default: BinDir().
	BinDir string
	// Nodes are the node identities (system:node:NAME in group system:nodes) given a static token. Default
	// {"node-1"}. With a kubelet, the kubelet registers Nodes[0].
	Nodes []string
	// CRIEndpoint, when set, starts a kubelet on this CRI runtime (unix://...). The runtime is the caller's
	// (integration/lab.StartContainerd, or deploy/lab/up.sh); Stop removes its pods before unmounting the
	// kubelet's volumes.
	CRIEndpoint string
	// CNIDir is the runtime's CNI conf_dir and bin_dir (one directory in both labs). Required with a kubelet:
	// without a loadable CNI config the Node stays NotReady, so a stub that runs host-network pods only is
	// written there.
	CNIDir string
	// KubeletConfig is appended to the kubelet's KubeletConfiguration YAML (top-level fields not already set,
	// such as imageGCHighThresholdPercent: 90).
	KubeletConfig string
	// Controllers starts kube-controller-manager and kube-scheduler beside the apiserver, so DaemonSets,
	// Deployments and StatefulSets become pods, pods without a nodeName are scheduled, and each namespace gets
	// its default ServiceAccount and kube-root-ca.crt ConfigMap. Default false: tests that place pods
	// themselves start faster without, and the pod GC controller would delete their pods bound to a node
	// that does not exist (Nodes other than the kubelet's).
	Controllers bool
	// Log receives one line per step. Default: discarded.
	Log io.Writer
	// Detach starts the processes in their own sessions so they outlive the caller (labctl kube-up); Down
	// removes such a lab.
	Detach bool
}

// Cluster is a running lab: etcd, kube-apiserver and perhaps the controllers and a kubelet.
type Cluster struct {
	opts   Options
	dir    string
	bin    string
	pki    *pki
	tokens map[string]string // user -> token: "admin" and each node name

	EtcdPort, EtcdPeerPort, APIServerPort int
	KubeletPort, KubeletHealthzPort       int
	NodeIP                                string

	etcd, apiserver, kubelet     *proc
	controllerManager, scheduler *proc // with Options.Controllers
	stopped                      bool
	lock                         *os.File // kubeletLock, held while this cluster's kubelet runs
}

// state is what a detached lab records in DIR/state.json for Down.
type state struct {
	CRIEndpoint string `json:"criEndpoint,omitempty"`
	KubeletRoot string `json:"kubeletRoot,omitempty"`
	APIServer   string `json:"apiServer"`
}

func (c *Cluster) logf(format string, args ...any) {
	if c.opts.Log != nil {
		fmt.Fprintf(c.opts.Log, "kubelab: "+format+"\n", args...)
	}
}

// Start starts etcd and kube-apiserver (then kube-controller-manager and kube-scheduler with
// opts.Controllers, and a kubelet when opts.CRIEndpoint is set) and waits until each is ready: etcd's
// /health, the apiserver's /readyz, the controller-manager's first ServiceAccount and ConfigMap, the
// kubelet's Node registered and its Pods API socket there. On error everything started is stopped again.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	if len(opts.Nodes) == 0 {
		opts.Nodes = []string{"node-1"}
	}
	if opts.CRIEndpoint != "" && opts.CNIDir == "" {
		return nil, errors.New("kubelab: a kubelet needs Options.CNIDir, the runtime's CNI directory")
	}
	if opts.BinDir == "" {
		if opts.BinDir, err = BinDir(); err != nil {
			return nil, err
		}
	}
	if os.Geteuid() != 0 && opts.CRIEndpoint != "" {
		return nil, errors.New("kubelab: a kubelet needs root")
	}
	if opts.Dir == "" {
		if opts.Dir, err = os.MkdirTemp("/tmp", DirPrefix); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, err
	}
	c = &Cluster{opts: opts, dir: opts.Dir, bin: opts.BinDir, tokens: map[string]string{}}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	t0 := time.Now()
	if c.pki, err = newPKI(filepath.Join(c.dir, "pki")); err != nil {
		return c, fmt.Errorf("kubelab: pki: %w", err)
	}
	if err := c.pki.issue("apiserver", "kube-apiserver", nil,
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}); err != nil {
		return c, fmt.Errorf("kubelab: pki: %w", err)
	}
	if err := c.writeTokens(); err != nil {
		return c, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return c, err
	}
	c.EtcdPort, c.EtcdPeerPort, c.APIServerPort = ports[0], ports[1], ports[2]
	if err := c.startEtcd(ctx); err != nil {
		return c, err
	}
	c.apiserver = &proc{name: "kube-apiserver", bin: filepath.Join(c.bin, "kube-apiserver"), dir: c.dir, detach: opts.Detach, args: c.apiserverArgs()}
	if err := c.StartAPIServer(ctx); err != nil {
		return c, err
	}
	for _, user := range append([]string{"admin"}, opts.Nodes...) {
		if err := c.writeKubeconfig(user); err != nil {
			return c, err
		}
	}
	c.logf("control plane ready in %s: https://127.0.0.1:%d", time.Since(t0).Round(time.Millisecond), c.APIServerPort)
	if opts.Controllers {
		if err := c.startControllers(); err != nil {
			return c, err
		}
	}
	if opts.CRIEndpoint != "" {
		if err := c.startKubelet(ctx); err != nil {
			return c, err
		}
		c.logf("kubelet ready (node %s) after %s", opts.Nodes[0], time.Since(t0).Round(time.Millisecond))
	}
	if opts.Controllers {
		if err := c.waitControllers(ctx); err != nil {
			return c, err
		}
		c.logf("controller-manager and scheduler ready after %s", time.Since(t0).Round(time.Millisecond))
	}
	st := state{CRIEndpoint: opts.CRIEndpoint, APIServer: c.Server()}
	if opts.CRIEndpoint != "" {
		st.KubeletRoot = c.KubeletRoot()
	}
	b, _ := json.MarshalIndent(st, "", "  ")
	return c, os.WriteFile(filepath.Join(c.dir, "state.json"), b, 0o644)
}

// Dir is the cluster's directory.
func (c *Cluster) Dir() string { return c.dir }

// Server is the apiserver's URL.
func (c *Cluster) Server() string { return "https://127.0.0.1:" + strconv.Itoa(c.APIServerPort) }

// CAFile is the lab CA's certificate (it signed the apiserver's serving certificate).
func (c *Cluster) CAFile() string { return c.pki.path("ca.crt") }

// KubeconfigPath is the kubeconfig file of user "admin" or of a node name.
func (c *Cluster) KubeconfigPath(user string) string {
	return filepath.Join(c.dir, user+".kubeconfig")
}

// AdminConfig is a client config with system:masters rights.
func (c *Cluster) AdminConfig() *rest.Config { return c.config("admin") }

// NodeConfig is the client config of node identity system:node:NODE (group system:nodes): the Node
// authorizer and NodeRestriction limit it to its own node's pods and their secrets and configmaps.
func (c *Cluster) NodeConfig(node string) *rest.Config { return c.config(node) }

func (c *Cluster) config(user string) *rest.Config {
	tok, ok := c.tokens[user]
	if !ok {
		panic(fmt.Sprintf("kubelab: no identity %q (Options.Nodes)", user))
	}
	return &rest.Config{
		Host:            c.Server(),
		BearerToken:     tok,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caPEM},
		// A test's load is no reason to throttle on the client: the apiserver's own limits are the real ones.
		QPS:   1000,
		Burst: 2000,
	}
}

// Admin is an admin clientset.
func (c *Cluster) Admin() (*kubernetes.Clientset, error) {
	return kubernetes.NewForConfig(c.AdminConfig())
}

// PrepareNamespace creates namespace ns with what a controller-manager would have put there: the default
// ServiceAccount (pods are refused without it) and the kube-root-ca.crt ConfigMap (a kubelet cannot mount a
// pod's service-account volume without it). Existing objects are kept.
func (c *Cluster) PrepareNamespace(ctx context.Context, ns string) error {
	return prepareNamespace(ctx, c.AdminConfig(), c.pki.caPEM, ns)
}

// PrepareNamespaceIn is PrepareNamespace for the lab in dir (labctl kube-ns): it reads the admin kubeconfig
// and the CA there.
func PrepareNamespaceIn(ctx context.Context, dir, ns string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "admin.kubeconfig"))
	if err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	ca, err := os.ReadFile(filepath.Join(dir, "pki", "ca.crt"))
	if err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	return prepareNamespace(ctx, cfg, ca, ns)
}

func prepareNamespace(ctx context.Context, cfg *rest.Config, caPEM []byte, ns string) error {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	create := func(what string, err error) error {
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("kubelab: create %s in %s: %w", what, ns, err)
		}
		return nil
	}
	_, err = cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err := create("namespace", err); err != nil {
		return err
	}
	_, err = cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if err := create("serviceaccount default", err); err != nil {
		return err
	}
	_, err = cs.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-root-ca.crt"},
		Data:       map[string]string{"ca.crt": string(caPEM)},
	}, metav1.CreateOptions{})
	return create("configmap kube-root-ca.crt", err)
}

func (c *Cluster) writeTokens() error {
	var b strings.Builder
	for _, user := range append([]string{"admin"}, c.opts.Nodes...) {
		raw := make([]byte, 16)
		if _, err := rand.Read(raw); err != nil {
			return err
		}
		tok := hex.EncodeToString(raw)
		c.tokens[user] = tok
		if user == "admin" {
			fmt.Fprintf(&b, "%s,admin,admin,\"system:masters\"\n", tok)
		} else {
			fmt.Fprintf(&b, "%s,system:node:%s,%s,\"system:nodes\"\n", tok, user, user)
		}
	}
	return os.WriteFile(filepath.Join(c.dir, "pki", "tokens.csv"), []byte(b.String()), 0o600)
}

func (c *Cluster) writeKubeconfig(user string) error {
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: lab
  context: {cluster: lab, user: %s}
current-context: lab
`, c.Server(), c.CAFile(), user, c.tokens[user], user)
	return os.WriteFile(c.KubeconfigPath(user), []byte(kc), 0o600)
}

func (c *Cluster) startEtcd(ctx context.Context) error {
	client := fmt.Sprintf("http://127.0.0.1:%d", c.EtcdPort)
	peer := fmt.Sprintf("http://127.0.0.1:%d", c.EtcdPeerPort)
	c.etcd = &proc{name: "etcd", bin: filepath.Join(c.bin, "etcd"), dir: c.dir, detach: c.opts.Detach, args: []string{
		"--name", "lab", "--data-dir", filepath.Join(c.dir, "etcd"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "lab=" + peer, "--listen-metrics-urls", "",
		"--log-level", "warn",
		// Throwaway test data: no fsync (deploy/lab/README.md).
		"--unsafe-no-fsync",
	}}
	if err := c.etcd.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	return c.waitHTTP(ctx, c.etcd, client+"/health", nil, 30*time.Second)
}

func (c *Cluster) apiserverArgs() []string {
	p := c.pki.path
	return []string{
		"--etcd-servers=http://127.0.0.1:" + strconv.Itoa(c.EtcdPort),
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(c.APIServerPort),
		// Loopback as the advertised address needs the endpoint reconciler off (else the apiserver exits).
		"--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
		"--tls-cert-file=" + p("apiserver.crt"), "--tls-private-key-file=" + p("apiserver.key"),
		"--client-ca-file=" + p("ca.crt"),
		"--token-auth-file=" + p("tokens.csv"),
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + p("sa.pub"), "--service-account-signing-key-file=" + p("sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--cert-dir=" + filepath.Join(c.dir, "apiserver-certs"),
		"--allow-privileged=true",
		"--kubelet-preferred-address-types=InternalIP,Hostname",
	}
}

// StartAPIServer starts kube-apiserver (again, after StopAPIServer) and waits for /readyz.
func (c *Cluster) StartAPIServer(ctx context.Context) error {
	if c.apiserver.running() {
		return errors.New("kubelab: kube-apiserver already running")
	}
	if err := c.apiserver.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.pki.caPEM)
	return c.waitHTTP(ctx, c.apiserver, c.Server()+"/readyz", &tls.Config{RootCAs: pool}, 90*time.Second)
}

// StopAPIServer stops kube-apiserver: SIGTERM, then SIGKILL after grace. Clients see their watches and
// connections end, as in a control-plane restart.
func (c *Cluster) StopAPIServer(grace time.Duration) { c.apiserver.stop(grace) }

// RestartAPIServer stops kube-apiserver (SIGTERM, SIGKILL after 5 s: with watches open it can take a
// minute to exit) and starts it again on the same port and etcd data.
func (c *Cluster) RestartAPIServer(ctx context.Context) error {
	c.StopAPIServer(5 * time.Second)
	return c.StartAPIServer(ctx)
}

// waitHTTP polls url until it answers 200 or the process exits (its log tail is in the error).
func (c *Cluster) waitHTTP(ctx context.Context, p *proc, url string, tlsConf *tls.Config, timeout time.Duration) error {
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsConf}}
	defer hc.CloseIdleConnections()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := hc.Do(req)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
		} else {
			last = err.Error()
		}
		if !p.running() {
			return fmt.Errorf("kubelab: %s exited before %s answered: %v\n%s", p.name, url, p.waitErr, p.logTail(30))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kubelab: %s not ready after %s (%s): %s\n%s", p.name, timeout, url, last, p.logTail(30))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// freePorts returns n distinct free loopback ports (listened on, then closed).
func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("kubelab: free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Stop stops everything in the clean-up order that leaves nothing behind (deploy/lab/README.md): the
// scheduler and controller-manager (nothing then recreates the pods removed next), the kubelet, the runtime's pods, the kubelet's mounts, its cgroups, its /var/log/containers links and device-plugin socket,
// then kube-apiserver and etcd, and removes the directory. It returns what could not be removed.
func (c *Cluster) Stop() error {
	if c.stopped {
		return nil
	}
	c.stopped = true
	var errs []error
	c.stopControllers()
	if c.kubelet != nil {
		c.kubelet.stop(10 * time.Second)
		errs = append(errs, cleanKubelet(c.opts.CRIEndpoint, c.KubeletRoot(), c.dir)...)
	}
	if c.lock != nil {
		c.lock.Close() // releases the flock
	}
	if c.apiserver != nil {
		c.apiserver.stop(5 * time.Second)
	}
	if c.etcd != nil {
		c.etcd.stop(5 * time.Second)
	}
	if err := os.RemoveAll(c.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Down removes a detached lab (labctl kube-down) from its directory, in Stop's order: the processes are
// found by the pid files Start wrote. It is safe to run twice.
func Down(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if errors.Is(err, os.ErrNotExist) {
		if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
			return nil
		}
	}
	var st state
	if err == nil {
		if err := json.Unmarshal(b, &st); err != nil {
			return fmt.Errorf("kubelab: %s: %w", filepath.Join(dir, "state.json"), err)
		}
	}
	var errs []error
	errs = append(errs, stopPIDFile(dir, "kube-scheduler", "kube-scheduler", 5*time.Second))
	errs = append(errs, stopPIDFile(dir, "kube-controller-manager", "kube-controller-manager", 5*time.Second))
	errs = append(errs, stopPIDFile(dir, "kubelet", "kubelet", 10*time.Second))
	if st.KubeletRoot != "" {
		errs = append(errs, cleanKubelet(st.CRIEndpoint, st.KubeletRoot, dir)...)
	}
	errs = append(errs, stopPIDFile(dir, "kube-apiserver", "kube-apiserver", 10*time.Second))
	errs = append(errs, stopPIDFile(dir, "etcd", "etcd", 5*time.Second))
	errs = append(errs, os.RemoveAll(dir))
	return errors.Join(errs...)
}
