// Package deploy_test validates the deployment files: every NATS config starts a real embedded server,
// gen-certs.sh produces certificates a TLS server accepts, the Helm chart lints, refuses bad values and renders
// objects that decode into their typed objects with least privilege and flags the binary has (its NATS
// configuration starting real servers), kubernetes/imagefleet.yaml is its current default render, and the
// systemd units name flags the binary has.
package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"flag"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nkeys"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/internal/authcallout"
	"github.com/imagefleet/imagefleet/internal/testport"
)

func freePort(t *testing.T) int {
	t.Helper()
	return testport.Free(t)
}

// rewrite copies a config with replacements (ports, certificate paths) into a temp file.
func rewrite(t *testing.T, path string, repl ...string) string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.NewReplacer(repl...).Replace(string(raw))
	out := filepath.Join(t.TempDir(), filepath.Base(path))
	if err := os.WriteFile(out, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	return out
}

func start(t *testing.T, conf string) *bus.Server {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf, Listen: "127.0.0.1:-1", StoreDir: t.TempDir()})
	if err != nil {
		t.Fatalf("start nats-server from %s: %v", conf, err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func TestSingleConfigStarts(t *testing.T) {
	conf := rewrite(t, "nats/single.conf", `"127.0.0.1:8222"`, fmt.Sprintf(`"127.0.0.1:%d"`, freePort(t)))
	srv := start(t, conf)
	b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{ConnectTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
}

// TestLeafConfigs: the hub and an edge start from deploy/nats/leaf-*.conf (certificate paths pointed at
// test certificates, ports at free ones); the edge connects as a leaf over TLS and a message published at the
// edge reaches a subscriber at the hub.
func TestLeafConfigs(t *testing.T) {
	certs, err := natsconf.GenerateCerts(t.TempDir(), nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	leafPort := freePort(t)
	paths := []string{
		"/etc/imagefleet/tls/server.pem", certs.ServerCert, "/etc/imagefleet/tls/server-key.pem", certs.ServerKey,
		"/etc/imagefleet/tls/client.pem", certs.ClientCert, "/etc/imagefleet/tls/client-key.pem", certs.ClientKey,
		"/etc/imagefleet/tls/ca.pem", certs.CA,
	}
	hub := start(t, rewrite(t, "nats/leaf-hub.conf", append(paths, `"0.0.0.0:7422"`, fmt.Sprintf(`"127.0.0.1:%d"`, leafPort))...))
	t.Setenv("IMAGEFLEET_HUB_LEAF_URL", fmt.Sprintf("nats-leaf://127.0.0.1:%d", leafPort))
	edge := start(t, rewrite(t, "nats/leaf-edge.conf", paths...))

	hb, err := bus.Connect(t.Context(), hub.ClientURL(), bus.Options{Name: "hub-client"})
	if err != nil {
		t.Fatal(err)
	}
	defer hb.Close()
	eb, err := bus.Connect(t.Context(), edge.ClientURL(), bus.Options{Name: "edge-client"})
	if err != nil {
		t.Fatal(err)
	}
	defer eb.Close()
	got := make(chan string, 16)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = hb.Subscribe(ctx, "imagefleet.evt.edge-1.>", func(subject string, _ map[string][]string, _ []byte) { got <- subject })
	}()
	defer func() { cancel(); <-done }()
	deadline := time.After(15 * time.Second)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := eb.PublishRaw("imagefleet.evt.edge-1.node.heartbeat", []byte("{}")); err != nil {
			t.Fatal(err)
		}
		select {
		case s := <-got:
			if s != "imagefleet.evt.edge-1.node.heartbeat" {
				t.Errorf("hub got %s", s)
			}
			return
		case <-tick.C:
		case <-deadline:
			t.Fatal("a message published at the edge did not reach the hub over the leaf connection")
		}
	}
}

// TestGenCertsScript: deploy/nats/gen-certs.sh (openssl) writes certificates a generated TLS config
// accepts, and a client with the client certificate connects.
func TestGenCertsScript(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Fatal("openssl is needed by deploy/nats/gen-certs.sh (apt-get install openssl)")
	}
	dir := t.TempDir()
	out, err := exec.Command("sh", "nats/gen-certs.sh", dir, "nats.example.com", "10.0.0.1").CombinedOutput()
	if err != nil {
		t.Fatalf("gen-certs.sh: %v\n%s", err, out)
	}
	for _, f := range []string{"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem"} {
		fi, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(f, "key.pem") && fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s mode %v: a key must not be readable by others", f, fi.Mode().Perm())
		}
	}
	creds := t.TempDir()
	res, err := natsconf.Generate(creds, natsconf.Options{Nodes: []string{"n1"},
		TLS: &natsconf.TLSFiles{CA: dir + "/ca.pem", Cert: dir + "/server.pem", Key: dir + "/server-key.pem"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := start(t, res.ConfigFile)
	b, err := bus.Connect(t.Context(), srv.ClientURL(), bus.Options{NKeyFile: natsconf.SeedFile(creds, natsconf.RoleNode, "n1"),
		TLSCA: dir + "/ca.pem", TLSCert: dir + "/client.pem", TLSKey: dir + "/client-key.pem", ConnectTimeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("connect with gen-certs.sh certificates: %v", err)
	}
	b.Close()
}

// TestSystemdUnits: the units run the binary with flags it has (checked against `imagefleet agent --help`
// and `imagefleet bus --help` of the binary built from this tree).
func TestSystemdUnits(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "imagefleet")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/imagefleet").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	for _, unit := range []string{"systemd/imagefleet-agent.service", "systemd/imagefleet-bus.service"} {
		raw, err := os.ReadFile(unit)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.ReplaceAll(string(raw), "\\\n", " ")
		var exec1 string
		for _, l := range strings.Split(text, "\n") {
			if strings.HasPrefix(l, "ExecStart=") {
				exec1 = strings.TrimPrefix(l, "ExecStart=")
			}
		}
		for _, sec := range []string{"[Unit]", "[Service]", "[Install]"} {
			if !strings.Contains(text, sec) {
				t.Errorf("%s has no %s", unit, sec)
			}
		}
		fields := strings.Fields(exec1)
		if len(fields) < 2 || filepath.Base(fields[0]) != "imagefleet" {
			t.Fatalf("%s ExecStart = %q", unit, exec1)
		}
		help, err := exec.Command(bin, fields[1], "--help").CombinedOutput()
		if err != nil {
			t.Fatalf("imagefleet %s --help: %v", fields[1], err)
		}
		for _, f := range fields[2:] {
			name, _, _ := strings.Cut(f, "=")
			if strings.HasPrefix(name, "--") && !strings.Contains(string(help), name+" ") {
				t.Errorf("%s: imagefleet %s has no flag %s", unit, fields[1], name)
			}
		}
	}
}

// TestClusterTLSConfigs: the three servers of deploy/nats/cluster-tls (certificate paths pointed at test
// certificates, ports at free ones) form a cluster over mutually authenticated TLS routes: a client with
// the client certificate creates replicated (R3) streams and stores an event; a client without a
// certificate is refused.
func TestClusterTLSConfigs(t *testing.T) {
	certs, err := natsconf.GenerateCerts(t.TempDir(), nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	repl := []string{
		"/etc/imagefleet/tls/server.pem", certs.ServerCert, "/etc/imagefleet/tls/server-key.pem", certs.ServerKey,
		"/etc/imagefleet/tls/ca.pem", certs.CA,
	}
	for i := range 3 {
		repl = append(repl,
			fmt.Sprintf("127.0.0.1:%d", 4222+i), fmt.Sprintf("127.0.0.1:%d", freePort(t)),
			fmt.Sprintf("127.0.0.1:%d", 6222+i), fmt.Sprintf("127.0.0.1:%d", freePort(t)),
			fmt.Sprintf("127.0.0.1:%d", 8222+i), fmt.Sprintf("127.0.0.1:%d", freePort(t)))
	}
	var urls []string
	for i := 1; i <= 3; i++ {
		conf := rewrite(t, fmt.Sprintf("nats/cluster-tls/server-%d.conf", i), repl...)
		srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf, StoreDir: t.TempDir()})
		if err != nil {
			t.Fatalf("start server %d: %v", i, err)
		}
		t.Cleanup(srv.Shutdown)
		urls = append(urls, srv.ClientURL())
	}
	url := strings.Join(urls, ",")
	b, err := bus.Connect(t.Context(), url, bus.Options{Name: "cluster-tls", TLSCA: certs.CA, TLSCert: certs.ClientCert,
		TLSKey: certs.ClientKey, ConnectTimeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("connect with the client certificate: %v", err)
	}
	defer b.Close()
	bustest.Eventually(t, "R3 streams over the TLS cluster", time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		return b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: 3})
	})
	info, err := b.Stream(t.Context(), "IMAGEFLEET_EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	if info.Replicas != 3 || info.Leader == "" {
		t.Fatalf("events stream %+v: want 3 replicas and a leader", info)
	}
	if _, err := bus.Connect(t.Context(), urls[0], bus.Options{Name: "no-cert", TLSCA: certs.CA, ConnectTimeout: 2 * time.Second}); err == nil {
		t.Fatal("a client without a certificate connected")
	}
}

// The chart (deploy/helm/imagefleet) and the manifest rendered from it (deploy/kubernetes/imagefleet.yaml).

var update = flag.Bool("update", false, "write kubernetes/imagefleet.yaml from the chart (go tool task chart:render)")

const (
	chartDir     = "helm/imagefleet"
	labValues    = chartDir + "/values-lab.yaml"
	renderedFile = "kubernetes/imagefleet.yaml"
	// The release and namespace of the rendered file and of every render below.
	release = "imagefleet"
)

// helm runs `go tool helm` (go.mod's tool line: built on first use) with a home of its own, so the user's Helm
// settings and repositories take no part.
func helm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	home := t.TempDir()
	cmd := exec.CommandContext(t.Context(), "go", append([]string{"tool", "helm"}, args...)...)
	cmd.Env = append(os.Environ(), "HELM_CONFIG_HOME="+home+"/config", "HELM_CACHE_HOME="+home+"/cache",
		"HELM_DATA_HOME="+home+"/data")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), nil
}

// doc is one object of a render, decoded strictly into its typed object.
type doc struct {
	kind, name string
	raw        string
	obj        any
}

// chart is one render of the chart.
type chart []doc

func renderChart(t *testing.T, args ...string) chart {
	t.Helper()
	out, err := helm(t, append([]string{"template", release, chartDir, "--namespace", release}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return decodeChart(t, out)
}

// splitDocs splits helm's output into its documents (each starts with helm's "# Source:" line).
func splitDocs(out string) []string {
	var docs []string
	for _, d := range strings.Split("\n"+out, "\n---\n") {
		if strings.TrimSpace(d) != "" {
			docs = append(docs, d)
		}
	}
	return docs
}

func decodeChart(t *testing.T, out string) chart {
	t.Helper()
	var c chart
	for i, raw := range splitDocs(out) {
		var meta struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal([]byte(raw), &meta); err != nil {
			t.Fatalf("document %d: %v\n%s", i, err, raw)
		}
		if meta.Kind == "" {
			continue // only comments
		}
		var obj any
		switch meta.Kind {
		case "ServiceAccount":
			obj = &corev1.ServiceAccount{}
		case "ConfigMap":
			obj = &corev1.ConfigMap{}
		case "Secret":
			obj = &corev1.Secret{}
		case "Service":
			obj = &corev1.Service{}
		case "DaemonSet":
			obj = &appsv1.DaemonSet{}
		case "Deployment":
			obj = &appsv1.Deployment{}
		case "StatefulSet":
			obj = &appsv1.StatefulSet{}
		case "Job":
			obj = &batchv1.Job{}
		case "PodDisruptionBudget":
			obj = &policyv1.PodDisruptionBudget{}
		case "CustomResourceDefinition":
			obj = &apiextensionsv1.CustomResourceDefinition{}
		case "ClusterRole", "Role":
			obj = &rbacv1.ClusterRole{}
		case "ClusterRoleBinding", "RoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		default:
			t.Fatalf("%s %s: a kind the chart should not make", meta.Kind, meta.Metadata.Name)
		}
		if err := yaml.UnmarshalStrict([]byte(raw), obj); err != nil {
			t.Fatalf("%s %s: %v", meta.Kind, meta.Metadata.Name, err)
		}
		c = append(c, doc{kind: meta.Kind, name: meta.Metadata.Name, raw: raw, obj: obj})
	}
	return c
}

func (c chart) get(kind, name string) (doc, bool) {
	for _, d := range c {
		if d.kind == kind && d.name == name {
			return d, true
		}
	}
	return doc{}, false
}

func (c chart) must(t *testing.T, kind, name string) any {
	t.Helper()
	d, ok := c.get(kind, name)
	if !ok {
		t.Fatalf("no %s %s in the render", kind, name)
	}
	return d.obj
}

// pod is a workload's pod template, with the workload's kind and name and its hook annotation.
type pod struct {
	what   string // "DaemonSet/imagefleet-agent"
	hook   string
	spec   corev1.PodSpec
	claims []string // a StatefulSet's volume claim templates
}

func (c chart) pods() []pod {
	var out []pod
	for _, d := range c {
		var tmpl corev1.PodTemplateSpec
		var annotations map[string]string
		var claims []string
		switch o := d.obj.(type) {
		case *appsv1.DaemonSet:
			tmpl, annotations = o.Spec.Template, o.Annotations
		case *appsv1.Deployment:
			tmpl, annotations = o.Spec.Template, o.Annotations
		case *appsv1.StatefulSet:
			tmpl, annotations = o.Spec.Template, o.Annotations
			for _, c := range o.Spec.VolumeClaimTemplates {
				claims = append(claims, c.Name)
			}
		case *batchv1.Job:
			tmpl, annotations = o.Spec.Template, o.Annotations
		default:
			continue
		}
		out = append(out, pod{what: d.kind + "/" + d.name, hook: annotations["helm.sh/hook"], spec: tmpl.Spec, claims: claims})
	}
	return out
}

func (c chart) pod(t *testing.T, what string) pod {
	t.Helper()
	for _, p := range c.pods() {
		if p.what == what {
			return p
		}
	}
	t.Fatalf("no %s in the render", what)
	return pod{}
}

// flag returns the value of --name=value in args.
func flagOf(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func (p pod) args() []string { return p.spec.Containers[0].Args }

func (p pod) volume(name string) (corev1.Volume, bool) {
	for _, v := range p.spec.Volumes {
		if v.Name == name {
			return v, true
		}
	}
	return corev1.Volume{}, false
}

// mountedAt is the volume mounted at dir in the first container.
func (p pod) mountedAt(dir string) (corev1.Volume, bool) {
	for _, m := range p.spec.Containers[0].VolumeMounts {
		if m.MountPath == dir {
			return p.volume(m.Name)
		}
	}
	return corev1.Volume{}, false
}

func (c chart) natsConf(t *testing.T) string {
	t.Helper()
	cm := c.must(t, "ConfigMap", release+"-nats-config").(*corev1.ConfigMap)
	return cm.Data["nats.conf"]
}

// TestChartLint: helm lint --strict passes with the default values and with the lab's.
func TestChartLint(t *testing.T) {
	for name, args := range map[string][]string{
		"defaults": nil,
		"lab":      {"-f", labValues, "--set", "kubernetesAPI.port=17443"},
	} {
		out, err := helm(t, append([]string{"lint", "--strict", chartDir}, args...)...)
		if err != nil {
			t.Errorf("%s: %v", name, err)
		} else if !strings.Contains(out, "0 chart(s) failed") {
			t.Errorf("%s: helm lint says:\n%s", name, out)
		}
	}
}

// TestChartRefuses: the schema refuses a wrong type, an unknown key and a value out of its set; the chart
// refuses combinations that cannot work, each with a message saying what to set.
func TestChartRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"wrong type", []string{"--set", "agent.gc.highThreshold=high"}, "at '/agent/gc/highThreshold': got string, want integer"},
		{"unknown key", []string{"--set", "nats.storage=10Gi"}, "additional properties 'storage' not allowed"},
		{"unknown top-level key", []string{"--set", "nodes=3"}, "additional properties 'nodes' not allowed"},
		{"unknown image key", []string{"--set", "image.name=x"}, "additional properties 'name' not allowed"},
		{"two servers", []string{"--set", "nats.replicas=2"}, "at '/nats/replicas'"},
		{"short-lived token", []string{"--set", "auth.tokenExpirationSeconds=60"}, "at '/auth/tokenExpirationSeconds'"},
		{"cri not a unix URL", []string{"--set", "agent.cri=/run/containerd/containerd.sock"}, "at '/agent/cri'"},
		{"unknown auth mode", []string{"--set", "auth.mode=password"}, "at '/auth/mode'"},
		{"no NATS and no URL", []string{"--set", "nats.enabled=false"}, "set nats.url"},
		{"nkey with the chart's NATS", []string{"--set", "auth.mode=nkey"}, "auth.mode nkey needs an existing NATS"},
		{"lab without the API server's port", []string{"-f", labValues}, "set kubernetesAPI.port"},
		{"host network, one metrics port", []string{"--set", "hostNetwork=true"}, "agent.metricsPort and central.metricsPort"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := helm(t, append([]string{"template", release, chartDir, "--namespace", release}, tc.args...)...)
			if err == nil {
				t.Fatalf("rendered; want a refusal saying %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("refused with:\n%v\nwant %q in it", err, tc.want)
			}
		})
	}
}

// renderCases are the value combinations every render test covers.
var renderCases = []struct {
	name string
	args []string
	// callout: identities are projected tokens; tls: clients get the CA; natsURL: what every client dials.
	callout, tls bool
	natsURL      string
}{
	{name: "defaults", callout: true, tls: true, natsURL: "tls://imagefleet-nats.imagefleet.svc:4222"},
	{name: "nats=3", args: []string{"--set", "nats.replicas=3"}, callout: true, tls: true,
		natsURL: "tls://imagefleet-nats.imagefleet.svc:4222"},
	{name: "existing nats", args: []string{"--set", "nats.enabled=false", "--set", "nats.url=tls://nats.example.com:4222",
		"--set", "tls.existingSecret=nats-ca"}, callout: true, tls: true, natsURL: "tls://nats.example.com:4222"},
	{name: "tls off", args: []string{"--set", "tls.enabled=false"}, callout: true, natsURL: "nats://imagefleet-nats.imagefleet.svc:4222"},
	{name: "nkey", args: []string{"--set", "nats.enabled=false", "--set", "nats.url=tls://nats.example.com:4222",
		"--set", "auth.mode=nkey", "--set", "auth.nkey.adminSecret=imagefleet-admin-nkey", "--set", "tls.existingSecret=nats-ca",
		"--set", "tls.clientSecret=nats-client"}, tls: true, natsURL: "tls://nats.example.com:4222"},
	{name: "cri given", args: []string{"--set", "agent.cri=unix:///run/k3s/containerd/containerd.sock"}, callout: true, tls: true,
		natsURL: "tls://imagefleet-nats.imagefleet.svc:4222"},
	{name: "apiserver pod source", args: []string{"--set", "agent.podSource=apiserver"}, callout: true, tls: true,
		natsURL: "tls://imagefleet-nats.imagefleet.svc:4222"},
	{name: "lab", args: []string{"-f", labValues, "--set", "kubernetesAPI.port=17443"}, callout: true, tls: true,
		natsURL: "tls://127.0.0.1:14222"},
}

// TestChartRenders: every combination renders objects that decode strictly, with the properties that hold for
// all of them (security contexts, identities, least-privilege RBAC, nothing referenced that is not there), and
// those of each combination.
func TestChartRenders(t *testing.T) {
	for _, rc := range renderCases {
		t.Run(rc.name, func(t *testing.T) {
			c := renderChart(t, rc.args...)
			checkPods(t, c, rc.callout, rc.tls, rc.natsURL)
			checkRBAC(t, c, rc.callout)
			switch rc.name {
			case "defaults":
				checkDefaults(t, c)
			case "nats=3":
				sts := c.must(t, "StatefulSet", release+"-nats").(*appsv1.StatefulSet)
				if *sts.Spec.Replicas != 3 || sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
					t.Errorf("NATS StatefulSet: %d replicas, %s; want 3, Parallel", *sts.Spec.Replicas, sts.Spec.PodManagementPolicy)
				}
				conf := c.natsConf(t)
				for _, want := range []string{"cluster {", "routes: $NATS_ROUTES", "password: $CALLOUT_PASSWORD", "verify: true"} {
					if !strings.Contains(conf, want) {
						t.Errorf("nats.conf lacks %q:\n%s", want, conf)
					}
				}
				if routes := natsRoutes(t, c); strings.Count(routes, "nats-route://route:$(CALLOUT_PASSWORD)@") != 3 {
					t.Errorf("NATS_ROUTES = %s: want the three servers with the route password", routes)
				}
				c.must(t, "PodDisruptionBudget", release+"-nats")
				if v, _ := flagOf(c.pod(t, "Job/imagefleet-bus-init-r1").args(), "--stream-replicas"); v != "3" {
					t.Errorf("bus init --stream-replicas=%q, want 3", v)
				}
			case "existing nats", "nkey":
				for _, k := range []string{"StatefulSet", "Service", "ConfigMap", "Secret"} {
					for _, d := range c {
						if d.kind == k {
							t.Errorf("%s %s rendered with nats.enabled false", d.kind, d.name)
						}
					}
				}
				if rc.name == "nkey" {
					agent := c.pod(t, "DaemonSet/imagefleet-agent")
					if v, ok := agent.mountedAt("/etc/imagefleet/nkey"); !ok || v.HostPath == nil || v.HostPath.Path != "/etc/imagefleet/nkey" {
						t.Errorf("agent's nkey volume %+v: want the host path /etc/imagefleet/nkey", v)
					}
					for _, gone := range []string{"Deployment/imagefleet-auth-callout", "Job/imagefleet-nats-keys"} {
						for _, p := range c.pods() {
							if p.what == gone {
								t.Errorf("%s rendered in nkey mode", gone)
							}
						}
					}
					if v, _ := flagOf(c.pod(t, "Job/imagefleet-bus-init-r1").args(), "--nkey"); v != "/etc/imagefleet/nkey/admin.nk" {
						t.Errorf("bus init --nkey=%q", v)
					}
				}
			case "tls off":
				if _, ok := c.get("Secret", release+"-nats-tls"); ok {
					t.Error("a TLS Secret with tls.enabled false")
				}
				if conf := c.natsConf(t); strings.Contains(conf, "tls {") {
					t.Errorf("nats.conf has a tls block with tls.enabled false:\n%s", conf)
				}
			case "cri given":
				agent := c.pod(t, "DaemonSet/imagefleet-agent")
				if v, _ := flagOf(agent.args(), "--cri"); v != "unix:///run/k3s/containerd/containerd.sock" {
					t.Errorf("agent --cri=%q", v)
				}
				if _, ok := flagOf(agent.args(), "--host-root"); ok {
					t.Error("agent has --host-root with --cri given")
				}
				if v, ok := agent.mountedAt("/run/k3s/containerd"); !ok || v.HostPath == nil || v.HostPath.Path != "/run/k3s/containerd" {
					t.Errorf("agent mounts %+v at /run/k3s/containerd: want the socket's host directory", v)
				}
				if _, ok := agent.mountedAt("/host/run"); ok {
					t.Error("agent mounts the host's /run with --cri given")
				}
			case "apiserver pod source":
				agent := c.pod(t, "DaemonSet/imagefleet-agent")
				if _, ok := agent.volume("pods-api"); ok {
					t.Error("agent mounts the Pods API directory with --pod-source apiserver")
				}
			case "lab":
				for _, p := range c.pods() {
					if !p.spec.HostNetwork || p.spec.DNSPolicy != corev1.DNSDefault {
						t.Errorf("%s: hostNetwork %t, dnsPolicy %s; want true, Default", p.what, p.spec.HostNetwork, p.spec.DNSPolicy)
					}
					if got := p.spec.Containers[0].Image; got != "127.0.0.1:5000/imagefleet:dev" {
						t.Errorf("%s: image %s", p.what, got)
					}
				}
				for _, what := range []string{"DaemonSet/imagefleet-agent", "Deployment/imagefleet-auth-callout", "Job/imagefleet-nats-keys"} {
					env := map[string]string{}
					for _, e := range c.pod(t, what).spec.Containers[0].Env {
						env[e.Name] = e.Value
					}
					if env["KUBERNETES_SERVICE_HOST"] != "127.0.0.1" || env["KUBERNETES_SERVICE_PORT"] != "17443" {
						t.Errorf("%s: API server env %v, want 127.0.0.1:17443", what, env)
					}
				}
				sts := c.must(t, "StatefulSet", release+"-nats").(*appsv1.StatefulSet)
				if len(sts.Spec.VolumeClaimTemplates) != 0 {
					t.Error("the lab has no storage provisioner: want no volume claim")
				}
			}
		})
	}
}

// natsRoutes is the NATS_ROUTES value of the NATS servers.
func natsRoutes(t *testing.T, c chart) string {
	t.Helper()
	for _, e := range c.pod(t, "StatefulSet/imagefleet-nats").spec.Containers[0].Env {
		if e.Name == "NATS_ROUTES" {
			return e.Value
		}
	}
	t.Fatal("no NATS_ROUTES in the NATS servers' environment")
	return ""
}

// checkPods: every container runs read-only, without capabilities or privilege escalation, as the image's
// user (the agent alone as root); every ServiceAccount, volume, ConfigMap and Secret it names is in the render
// or made by the keys hook or given in the values; every NATS client dials natsURL with a projected token of
// its ServiceAccount for the callout's audience (or an nkey) and the CA when TLS is on.
func checkPods(t *testing.T, c chart, callout, withTLS bool, natsURL string) {
	t.Helper()
	external := map[string]bool{release + "-nats-keys": true, "nats-ca": true, "nats-client": true,
		"imagefleet-admin-nkey": true, "imagefleet-inventory-nkey": true}
	for _, p := range c.pods() {
		if len(p.spec.Containers) != 1 {
			t.Errorf("%s: %d containers", p.what, len(p.spec.Containers))
			continue
		}
		ctr := p.spec.Containers[0]
		sc := ctr.SecurityContext
		if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil ||
			*sc.AllowPrivilegeEscalation || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
			len(sc.Capabilities.Add) > 0 || sc.Privileged != nil && *sc.Privileged {
			t.Errorf("%s: security context %+v: want a read-only root, no privilege escalation, every capability dropped", p.what, sc)
		}
		if p.what == "DaemonSet/imagefleet-agent" {
			if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 {
				t.Errorf("agent: want uid 0 (the CRI and Pods API sockets are root's)")
			}
		} else if psc := p.spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil ||
			*psc.RunAsUser != 65532 || sc.RunAsUser != nil {
			t.Errorf("%s: pod security context %+v: want the image's user 65532, non-root", p.what, psc)
		}
		if sa := p.spec.ServiceAccountName; sa != "" {
			if _, ok := c.get("ServiceAccount", sa); !ok {
				t.Errorf("%s: ServiceAccount %s is not in the render", p.what, sa)
			}
		} else if p.what != "StatefulSet/imagefleet-nats" {
			t.Errorf("%s: no ServiceAccount of its own", p.what)
		}
		for _, m := range ctr.VolumeMounts {
			if _, ok := p.volume(m.Name); !ok && !slices.Contains(p.claims, m.Name) {
				t.Errorf("%s: mounts volume %s, which it does not have", p.what, m.Name)
			}
		}
		for _, v := range p.spec.Volumes {
			var name, kind string
			switch {
			case v.Secret != nil:
				name, kind = v.Secret.SecretName, "Secret"
			case v.ConfigMap != nil:
				name, kind = v.ConfigMap.Name, "ConfigMap"
			default:
				continue
			}
			if _, ok := c.get(kind, name); !ok && !external[name] {
				t.Errorf("%s: volume %s names %s %s, which is not in the render", p.what, v.Name, kind, name)
			}
		}
		args := ctr.Args
		if slices.Contains([]string{"agent", "bus"}, args[0]) && len(args) > 1 && (args[0] == "agent" || args[1] == "init") {
			checkNATSClient(t, p, callout, withTLS, natsURL)
		}
	}
}

func checkNATSClient(t *testing.T, p pod, callout, withTLS bool, natsURL string) {
	t.Helper()
	args := p.args()
	if v, _ := flagOf(args, "--nats"); v != natsURL {
		t.Errorf("%s: --nats=%q, want %q", p.what, v, natsURL)
	}
	if callout {
		file, ok := flagOf(args, "--token-file")
		v, mounted := p.mountedAt(filepath.Dir(file))
		if !ok || !mounted || v.Projected == nil || len(v.Projected.Sources) != 1 || v.Projected.Sources[0].ServiceAccountToken == nil {
			t.Errorf("%s: --token-file=%q: want a projected ServiceAccount token mounted there", p.what, file)
		} else if tok := v.Projected.Sources[0].ServiceAccountToken; tok.Audience != "imagefleet-nats" || tok.ExpirationSeconds == nil ||
			*tok.ExpirationSeconds != 3600 || tok.Path != filepath.Base(file) {
			t.Errorf("%s: token %+v: want audience imagefleet-nats, 3600 s, at %s", p.what, tok, file)
		}
		if _, ok := flagOf(args, "--nkey"); ok {
			t.Errorf("%s: an nkey beside the token", p.what)
		}
	} else if _, ok := flagOf(args, "--nkey"); !ok {
		t.Errorf("%s: no --nkey in nkey mode", p.what)
	}
	ca, ok := flagOf(args, "--tls-ca")
	if ok != withTLS {
		t.Errorf("%s: --tls-ca given %t, want %t", p.what, ok, withTLS)
	}
	if ok {
		if v, mounted := p.mountedAt(filepath.Dir(ca)); !mounted || v.Secret == nil || len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "ca.crt" {
			t.Errorf("%s: --tls-ca=%s: want the CA alone of a Secret mounted there, got %+v", p.what, ca, v)
		}
	}
}

// checkRBAC: the roles are exactly these grants, each bound to its one ServiceAccount; no wildcard.
func checkRBAC(t *testing.T, c chart, callout bool) {
	t.Helper()
	want := map[string]string{"ClusterRole/imagefleet-agent-events": "events:create,patch"}
	bound := map[string]string{"ClusterRole/imagefleet-agent-events": "imagefleet/imagefleet-agent"}
	if callout {
		want["ClusterRole/imagefleet-auth-callout"] = "authentication.k8s.io/tokenreviews:create"
		bound["ClusterRole/imagefleet-auth-callout"] = "imagefleet/imagefleet-auth-callout"
		want["Role/imagefleet-nats-keys"] = "secrets[imagefleet-nats-keys]:get,update secrets:create"
		bound["Role/imagefleet-nats-keys"] = "imagefleet/imagefleet-nats-keys"
	}
	if agent, ok := flagOf(c.pod(t, "DaemonSet/imagefleet-agent").args(), "--pod-source"); ok && agent == "apiserver" {
		want["ClusterRole/imagefleet-agent-pods"] = "pods:list,watch"
		bound["ClusterRole/imagefleet-agent-pods"] = "imagefleet/imagefleet-agent"
	}
	for _, d := range c {
		if d.kind+"/"+d.name != "Deployment/imagefleet-central" {
			continue
		}
		if w, _ := flagOf(c.pod(t, "Deployment/imagefleet-central").args(), "--workers"); slices.Contains(strings.Split(w, ","), "controller") {
			want["ClusterRole/imagefleet-central-controller"] = "imagefleet.io/imageprepulls:get,list,watch,delete imagefleet.io/imagegcs:get,list,watch,delete " +
				"imagefleet.io/imageprepulls/status:patch imagefleet.io/imagegcs/status:patch " +
				"imagefleet.io/imagegcpolicies:get,list,watch imagefleet.io/imagegcpolicies/status:patch events.k8s.io/events:create,patch nodes:get,list,watch,patch"
			bound["ClusterRole/imagefleet-central-controller"] = "imagefleet/imagefleet-central"
			want["Role/imagefleet-central-leader"] = "coordination.k8s.io/leases:create coordination.k8s.io/leases[imagefleet-controller]:get,update"
			bound["Role/imagefleet-central-leader"] = "imagefleet/imagefleet-central"
		}
	}
	got, gotBound := map[string]string{}, map[string]string{}
	for _, d := range c {
		switch o := d.obj.(type) {
		case *rbacv1.ClusterRole:
			var grants []string
			for _, r := range o.Rules {
				for _, res := range r.Resources {
					g := res
					if r.APIGroups[0] != "" {
						g = r.APIGroups[0] + "/" + res
					}
					if len(r.ResourceNames) > 0 {
						g += "[" + strings.Join(r.ResourceNames, ",") + "]"
					}
					grants = append(grants, g+":"+strings.Join(r.Verbs, ","))
				}
				if len(r.APIGroups) != 1 || len(r.NonResourceURLs) > 0 || slices.Contains(r.Verbs, "*") || slices.Contains(r.Resources, "*") {
					t.Errorf("%s %s rule %+v: one API group, named resources and verbs only", d.kind, d.name, r)
				}
			}
			got[d.kind+"/"+d.name] = strings.Join(grants, " ")
		case *rbacv1.ClusterRoleBinding:
			var subjects []string
			for _, s := range o.Subjects {
				subjects = append(subjects, s.Namespace+"/"+s.Name)
			}
			gotBound[o.RoleRef.Kind+"/"+o.RoleRef.Name] = strings.Join(subjects, " ")
		}
	}
	if !maps.Equal(got, want) {
		t.Errorf("roles grant %v, want %v", got, want)
	}
	if !maps.Equal(gotBound, bound) {
		t.Errorf("roles are bound to %v, want %v", gotBound, bound)
	}
}

// checkDefaults: what the default install is: the agent searches the host's /run for the socket, the
// callout knows the three ServiceAccounts, the hooks run in order, and the generated certificate serves the
// Service's and every server's names for both TLS roles.
func checkDefaults(t *testing.T, c chart) {
	t.Helper()
	agent := c.pod(t, "DaemonSet/imagefleet-agent")
	if v, _ := flagOf(agent.args(), "--host-root"); v != "/host" {
		t.Errorf("agent --host-root=%q, want /host", v)
	}
	if _, ok := flagOf(agent.args(), "--cri"); ok {
		t.Error("agent --cri given by default: want the socket search")
	}
	if v, ok := agent.mountedAt("/host/run"); !ok || v.HostPath == nil || v.HostPath.Path != "/run" {
		t.Errorf("agent: the host's /run at /host/run: %+v", v)
	}
	for _, m := range agent.spec.Containers[0].VolumeMounts {
		if v, _ := agent.volume(m.Name); v.HostPath != nil && m.Name != "state" && !m.ReadOnly {
			t.Errorf("agent mounts host path %s writable", v.HostPath.Path)
		}
	}
	callout := c.pod(t, "Deployment/imagefleet-auth-callout").args()
	for _, want := range []string{"--node-service-account=imagefleet/imagefleet-agent", "--role=central=imagefleet/imagefleet-central",
		"--role=admin=imagefleet/imagefleet-operator", "--audience=imagefleet-nats", "--user=callout"} {
		if !slices.Contains(callout, want) {
			t.Errorf("auth callout args %q lack %s", callout, want)
		}
	}
	keys := c.pod(t, "Job/imagefleet-nats-keys")
	if keys.hook != "pre-install,pre-upgrade" || !slices.Equal(keys.args()[:2], []string{"bus", "keys"}) ||
		!slices.Contains(keys.args(), "--secret=imagefleet-nats-keys") || !slices.Contains(keys.args(), "--namespace=imagefleet") {
		t.Errorf("keys Job: hook %q, args %q", keys.hook, keys.args())
	}
	for _, kind := range []string{"ServiceAccount", "Role", "RoleBinding"} {
		d, _ := c.get(kind, "imagefleet-nats-keys")
		var meta map[string]string
		switch o := d.obj.(type) {
		case *corev1.ServiceAccount:
			meta = o.Annotations
		case *rbacv1.ClusterRole:
			meta = o.Annotations
		case *rbacv1.ClusterRoleBinding:
			meta = o.Annotations
		}
		if meta["helm.sh/hook"] != "pre-install,pre-upgrade" || meta["helm.sh/hook-weight"] != "-10" {
			t.Errorf("%s imagefleet-nats-keys: annotations %v: want a pre-install hook made before the Job", kind, meta)
		}
	}
	init := c.pod(t, "Job/imagefleet-bus-init-r1")
	// A plain Job, not a hook: helm install --wait waits for it, and the agents are Ready only after it ran.
	if init.hook != "" || init.spec.ServiceAccountName != "imagefleet-operator" {
		t.Errorf("bus init Job: hook %q (want none), ServiceAccount %q", init.hook, init.spec.ServiceAccountName)
	}
	conf := c.natsConf(t)
	// The names of the callout's contract, as deploy/natsconf and internal/authcallout spell them.
	for _, want := range []string{"issuer: $" + natsconf.DefaultIssuerEnv, fmt.Sprintf("auth_users: [ %q ]", natsconf.CalloutUser),
		"account: " + natsconf.CalloutAccount, natsconf.Account + " {\n    jetstream: enabled",
		fmt.Sprintf("{ user: %q, password: $%s }", natsconf.CalloutUser, natsconf.DefaultPasswordEnv), "tls {"} {
		if !strings.Contains(conf, want) {
			t.Errorf("nats.conf lacks %q:\n%s", want, conf)
		}
	}
	env := map[string]string{}
	for _, e := range c.pod(t, "StatefulSet/imagefleet-nats").spec.Containers[0].Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			env[e.Name] = e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
		}
	}
	if want := map[string]string{natsconf.DefaultIssuerEnv: "imagefleet-nats-keys/" + authcallout.KeyIssuerPub,
		natsconf.DefaultPasswordEnv: "imagefleet-nats-keys/" + authcallout.KeyPassword}; !maps.Equal(env, want) {
		t.Errorf("NATS servers' environment from Secrets %v, want %v", env, want)
	}
	calloutPod := c.pod(t, "Deployment/imagefleet-auth-callout")
	keysVol, _ := calloutPod.volume("keys")
	var items []string
	if keysVol.Secret != nil && keysVol.Secret.SecretName == "imagefleet-nats-keys" {
		for _, it := range keysVol.Secret.Items {
			items = append(items, it.Key)
		}
	}
	if !slices.Equal(items, []string{authcallout.KeyPassword, authcallout.KeyIssuerSeed}) {
		t.Errorf("auth callout mounts %v of imagefleet-nats-keys, want its password and issuer seed", items)
	}
	for _, a := range []string{"--password-file=/etc/imagefleet/callout/" + authcallout.KeyPassword,
		"--issuer-seed-file=/etc/imagefleet/callout/" + authcallout.KeyIssuerSeed, "--user=" + natsconf.CalloutUser} {
		if !slices.Contains(calloutPod.args(), a) {
			t.Errorf("auth callout args %q lack %s", calloutPod.args(), a)
		}
	}
	if strings.Contains(conf, "cluster {") {
		t.Error("one server with a cluster block")
	}
	sec := c.must(t, "Secret", release+"-nats-tls").(*corev1.Secret)
	ca := x509.NewCertPool()
	if !ca.AppendCertsFromPEM(sec.Data["ca.crt"]) {
		t.Fatal("the generated ca.crt holds no certificate")
	}
	if _, err := tls.X509KeyPair(sec.Data["tls.crt"], sec.Data["tls.key"]); err != nil {
		t.Fatalf("the generated tls.crt and tls.key: %v", err)
	}
	block, _ := pem.Decode(sec.Data["tls.crt"])
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"imagefleet-nats.imagefleet.svc", "imagefleet-nats.imagefleet.svc.cluster.local",
		"imagefleet-nats-2.imagefleet-nats-headless.imagefleet.svc.cluster.local", "localhost", "127.0.0.1"} {
		for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
			if _, err := cert.Verify(x509.VerifyOptions{DNSName: name, Roots: ca, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
				t.Errorf("the generated certificate for %s (usage %d): %v", name, usage, err)
			}
		}
	}
}

// TestChartFlags: every container of every combination runs a command the binary has, with flags it has, and
// the agent runs at least the binary's default workers.
func TestChartFlags(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "imagefleet")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/imagefleet").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	helps := map[string]string{}
	help := func(cmd []string) (string, error) {
		key := strings.Join(cmd, " ")
		if h, ok := helps[key]; ok {
			return h, nil
		}
		out, err := exec.Command(bin, append(slices.Clone(cmd), "--help")...).CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("imagefleet %s --help: %w\n%s", key, err, out)
		}
		// An unknown subcommand of a command that takes arguments prints its parent's help.
		if !strings.Contains(string(out), "imagefleet "+key+" ") && !strings.Contains(string(out), "imagefleet "+key+"\n") {
			return "", fmt.Errorf("imagefleet has no command %q", key)
		}
		helps[key] = string(out)
		return helps[key], nil
	}
	for _, rc := range renderCases {
		for _, p := range renderChart(t, rc.args...).pods() {
			args := p.args()
			i := slices.IndexFunc(args, func(a string) bool { return strings.HasPrefix(a, "--") })
			if i < 0 {
				i = len(args)
			}
			h, err := help(args[:i])
			if err != nil {
				t.Errorf("%s (%s): %v", p.what, rc.name, err)
				continue
			}
			for _, a := range args[i:] {
				name, _, _ := strings.Cut(a, "=")
				if !strings.Contains(h, name+" ") {
					t.Errorf("%s (%s): imagefleet %s has no flag %s", p.what, rc.name, strings.Join(args[:i], " "), name)
				}
			}
			if p.what == "DaemonSet/imagefleet-agent" {
				m := regexp.MustCompile(`\(default: ([a-z,-]+)\)`).FindStringSubmatch(h)
				if m == nil {
					t.Fatal("no default worker list in imagefleet agent --help")
				}
				workers, _ := flagOf(args, "--workers")
				for _, w := range append(strings.Split(m[1], ","), "kube-events") {
					if w != "journal" && !slices.Contains(strings.Split(workers, ","), w) {
						t.Errorf("agent (%s): workers %q lack %s", rc.name, workers, w)
					}
				}
			}
		}
	}
}

// chartNATS starts one server of the chart's NATS StatefulSet in this process: its nats.conf with the pod's
// certificate directory, cluster and monitoring ports pointed at test ones and its POD_NAME given; the rest of
// its environment (CALLOUT_PASSWORD, ISSUER_PUB, NATS_ROUTES) is the caller's t.Setenv.
func chartNATS(t *testing.T, conf, name, tlsDir string, clusterPort, monitorPort int) *bus.Server {
	t.Helper()
	repl := []string{"$POD_NAME", strconv.Quote(name), "/etc/imagefleet/nats-tls/", tlsDir + "/",
		`"0.0.0.0:8222"`, fmt.Sprintf(`"127.0.0.1:%d"`, monitorPort), `"0.0.0.0:6222"`, fmt.Sprintf(`"127.0.0.1:%d"`, clusterPort)}
	for i := 0; i < len(repl); i += 2 {
		if strings.HasPrefix(repl[i], `"0.0.0.0:6222"`) && !strings.Contains(conf, "cluster {") {
			continue
		}
		if repl[i] == "/etc/imagefleet/nats-tls/" && !strings.Contains(conf, "tls {") {
			continue
		}
		if !strings.Contains(conf, repl[i]) {
			t.Fatalf("nats.conf has no %s to point at the test's:\n%s", repl[i], conf)
		}
	}
	path := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(path, []byte(strings.NewReplacer(repl...).Replace(conf)), 0o600); err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: path, Listen: "127.0.0.1:-1", StoreDir: t.TempDir()})
	if err != nil {
		t.Fatalf("start %s from the chart's nats.conf: %v", name, err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// chartTLS writes the render's generated CA, certificate and key where chartNATS points the config.
func chartTLS(t *testing.T, c chart) string {
	t.Helper()
	dir := t.TempDir()
	sec := c.must(t, "Secret", release+"-nats-tls").(*corev1.Secret)
	for _, k := range []string{"ca.crt", "tls.crt", "tls.key"} {
		if err := os.WriteFile(filepath.Join(dir, k), sec.Data[k], 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// calloutEnv sets the server's environment from a Secret as `imagefleet bus keys` makes it: a password
// starting with a letter and an account public key.
func calloutEnv(t *testing.T) string {
	t.Helper()
	kp, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	password := "p0123456789abcdef0123456789abcdef0123456789abcdef"
	t.Setenv("CALLOUT_PASSWORD", password)
	t.Setenv("ISSUER_PUB", pub)
	return password
}

// TestChartNATSServer: the chart's nats.conf starts a real server from the environment the StatefulSet gives
// it, serving TLS with the chart's generated certificate: the callout's user connects with its password and
// the CA the clients mount; a wrong password is refused; the probes' health endpoint answers.
func TestChartNATSServer(t *testing.T) {
	c := renderChart(t)
	password := calloutEnv(t)
	dir := chartTLS(t, c)
	monitor := freePort(t)
	srv := chartNATS(t, c.natsConf(t), "imagefleet-nats-0", dir, 0, monitor)
	opts := bus.Options{Name: "callout", User: "callout", Password: password, TLSCA: filepath.Join(dir, "ca.crt"), ConnectTimeout: 5 * time.Second}
	b, err := bus.Connect(t.Context(), srv.ClientURL(), opts)
	if err != nil {
		t.Fatalf("the callout's user over TLS with the chart's CA: %v", err)
	}
	b.Close()
	opts.Password, opts.ConnectTimeout = "p-not-the-password", 2*time.Second
	if b, err := bus.Connect(t.Context(), srv.ClientURL(), opts); err == nil {
		b.Close()
		t.Fatal("the callout's user connected with a wrong password")
	}
	healthz(t, monitor)
}

// healthz waits for the probes' endpoints of the server monitoring on port to answer 200.
func healthz(t *testing.T, port int) {
	t.Helper()
	for _, path := range []string{"/healthz?js-enabled-only=true", "/healthz?js-server-only=true"} {
		bustest.Eventually(t, path, time.Minute, func() error {
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %s", path, resp.Status)
			}
			return nil
		})
	}
}

// TestChartNATSCluster: with nats.replicas 3 the chart's three servers form a JetStream cluster over their
// routes, given the routes as Kubernetes expands NATS_ROUTES (the route password from CALLOUT_PASSWORD), with
// and without TLS; a route connection without the password is refused.
func TestChartNATSCluster(t *testing.T) {
	for _, withTLS := range []bool{true, false} {
		t.Run(fmt.Sprintf("tls=%t", withTLS), func(t *testing.T) {
			c := renderChart(t, "--set", "nats.replicas=3", "--set", fmt.Sprintf("tls.enabled=%t", withTLS))
			password := calloutEnv(t)
			dir := ""
			if withTLS {
				dir = chartTLS(t, c)
			}
			var cluster, monitor [3]int
			for i := range 3 {
				cluster[i], monitor[i] = freePort(t), freePort(t)
			}
			// What the kubelet gives the container: $(CALLOUT_PASSWORD) expanded; the servers' DNS names here
			// are this machine's ports.
			i := 0
			routes := regexp.MustCompile(`@imagefleet-nats-\d\.[a-z.-]+:6222`).ReplaceAllStringFunc(
				strings.ReplaceAll(natsRoutes(t, c), "$(CALLOUT_PASSWORD)", password), func(string) string {
					i++
					return fmt.Sprintf("@127.0.0.1:%d", cluster[i-1])
				})
			if i != 3 {
				t.Fatalf("NATS_ROUTES %s: want three servers", natsRoutes(t, c))
			}
			t.Setenv("NATS_ROUTES", routes)
			for i := range 3 {
				chartNATS(t, c.natsConf(t), fmt.Sprintf("imagefleet-nats-%d", i), dir, cluster[i], monitor[i])
			}
			for i := range 3 {
				bustest.Eventually(t, "a JetStream meta leader among three servers", time.Minute, func() error {
					resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/jsz", monitor[i]))
					if err != nil {
						return err
					}
					defer resp.Body.Close()
					var jsz struct {
						Meta struct {
							Leader string `json:"leader"`
							Size   int    `json:"cluster_size"`
						} `json:"meta_cluster"`
					}
					if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
						return err
					}
					if jsz.Meta.Leader == "" || jsz.Meta.Size != 3 {
						return fmt.Errorf("server %d: meta cluster %+v", i, jsz.Meta)
					}
					return nil
				})
				healthz(t, monitor[i])
			}
			if got := routeConnect(t, cluster[0], dir); !strings.HasPrefix(got, "-ERR 'Authorization Violation'") {
				t.Fatalf("a route connection without the password: the server said %q, want an authorization violation", got)
			}
		})
	}
}

// routeConnect connects to a server's route port as a server would, without credentials (but with the
// servers' own certificate when tlsDir is set), and returns the server's answer to its CONNECT.
func routeConnect(t *testing.T, port int, tlsDir string) string {
	t.Helper()
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	// Routes over TLS start with the handshake; the server's INFO comes after it.
	var c net.Conn = conn
	if tlsDir != "" {
		cert, err := tls.LoadX509KeyPair(filepath.Join(tlsDir, "tls.crt"), filepath.Join(tlsDir, "tls.key"))
		if err != nil {
			t.Fatal(err)
		}
		pem, err := os.ReadFile(filepath.Join(tlsDir, "ca.crt"))
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(pem)
		tc := tls.Client(conn, &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12})
		if err := tc.Handshake(); err != nil {
			t.Fatalf("route TLS handshake with the servers' certificate: %v", err)
		}
		c = tc
	}
	r := bufio.NewReader(c)
	if info, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(info, "INFO ") {
		t.Fatalf("route port: %q, %v", info, err)
	}
	fmt.Fprintf(c, "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":%t,\"name\":\"rogue\",\"cluster\":\"imagefleet\"}\r\nPING\r\n", tlsDir != "")
	line, err := r.ReadString('\n')
	if err != nil {
		t.Fatalf("route port after CONNECT: %v", err)
	}
	return strings.TrimSpace(line)
}

// renderedHeader starts deploy/kubernetes/imagefleet.yaml.
var renderedHeader = strings.ReplaceAll(`# imagefleet as the chart installs it with its default values: 'helm template imagefleet deploy/helm/imagefleet
# --namespace imagefleet', written by 'go tool task chart:render' ('go test ./deploy/' fails when it is out of
# date). Do not edit: change the chart and render again.
#
# Install with Helm (docs/install.md). This file is the reference of what that creates, for review and diff.
# Applied with kubectl instead (into an existing namespace imagefleet), two things differ. The Secret
# imagefleet-nats-tls, which Helm generates at install (a CA and the certificate of the NATS servers), is
# left out, since its keys must not be in a repository: create it first, with ca.crt, tls.crt and tls.key for
# the names imagefleet-nats.imagefleet.svc and *.imagefleet-nats-headless.imagefleet.svc.cluster.local. And
# the keys hook Job (imagefleet-nats-keys) runs as a plain Job beside everything else, retried until what it
# needs is up; before applying a newer file, delete the completed Job imagefleet-bus-init-r1 (a Job's pod
# template cannot change).
`, "'", "`")

// renderedManifest is the default render without the generated TLS Secret (new keys at every render).
func renderedManifest(t *testing.T) []byte {
	t.Helper()
	out, err := helm(t, "template", release, chartDir, "--namespace", release)
	if err != nil {
		t.Fatal(err)
	}
	var keep []string
	dropped := 0
	for _, d := range splitDocs(out) {
		dc := decodeChart(t, d)
		if len(dc) == 1 && dc[0].kind == "Secret" && dc[0].name == release+"-nats-tls" {
			dropped++
			continue
		}
		keep = append(keep, strings.TrimPrefix(d, "\n"))
	}
	if dropped != 1 {
		t.Fatalf("the default render has %d generated TLS Secrets, want 1", dropped)
	}
	return []byte(renderedHeader + "---\n" + strings.Join(keep, "\n---\n") + "\n")
}

// TestRenderedManifest: deploy/kubernetes/imagefleet.yaml is the chart's default render (-update writes it).
func TestRenderedManifest(t *testing.T) {
	got := renderedManifest(t)
	if *update {
		if err := os.MkdirAll(filepath.Dir(renderedFile), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(renderedFile, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(renderedFile)
	if err != nil {
		t.Fatalf("%v: run `go tool task chart:render`", err)
	}
	if !bytes.Equal(got, want) {
		gl, wl := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
		n := 0
		for n < len(gl) && n < len(wl) && gl[n] == wl[n] {
			n++
		}
		line := func(ls []string) string {
			if n < len(ls) {
				return ls[n]
			}
			return "(end of file)"
		}
		t.Fatalf("deploy/%s is out of date with the chart: run `go tool task chart:render`. First difference, line %d:\n  file:  %s\n  chart: %s",
			renderedFile, n+1, line(wl), line(gl))
	}
}
