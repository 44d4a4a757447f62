// Package deploy_test validates the deployment files: every NATS config starts a real embedded server,
// gen-certs.sh produces certificates a TLS server accepts, the Kubernetes manifests decode into their typed
// objects, and the systemd units name flags the binary has.
package deploy_test

import (
	"bytes"
	"context"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
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

// TestKubernetesManifests: every document decodes strictly into its typed object; the agent DaemonSet mounts
// the containerd socket and the kubelet's Pods API directory, runs every default worker and the kube-events
// bridge with flags the binary has, under the imagefleet-agent ServiceAccount; and that ServiceAccount's
// roles are least privilege: events create and patch, and (only for the API-server pod source) pods list and
// watch, nothing on secrets, no wildcard.
func TestKubernetesManifests(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "imagefleet")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/imagefleet").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	help, err := exec.Command(bin, "agent", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("imagefleet agent --help: %v\n%s", err, help)
	}
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	kinds := map[string]int{}
	rules := map[string][]rbacv1.PolicyRule{}
	bound := map[string]string{} // ClusterRole -> ServiceAccount
	var agentSA string
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range bytes.Split(raw, []byte("\n---\n")) {
			if len(bytes.TrimSpace(doc)) == 0 {
				continue
			}
			var meta struct {
				Kind string `json:"kind"`
			}
			if err := yaml.Unmarshal(doc, &meta); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var obj any
			switch meta.Kind {
			case "DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "Deployment":
				obj = &appsv1.Deployment{}
			case "ConfigMap":
				obj = &corev1.ConfigMap{}
			case "Namespace":
				obj = &corev1.Namespace{}
			case "ServiceAccount":
				obj = &corev1.ServiceAccount{}
			case "ClusterRole":
				obj = &rbacv1.ClusterRole{}
			case "ClusterRoleBinding":
				obj = &rbacv1.ClusterRoleBinding{}
			default:
				t.Fatalf("%s document %d: unexpected kind %q", f, i, meta.Kind)
			}
			if err := yaml.UnmarshalStrict(doc, obj); err != nil {
				t.Fatalf("%s document %d (%s): %v", f, i, meta.Kind, err)
			}
			kinds[meta.Kind]++
			switch o := obj.(type) {
			case *rbacv1.ClusterRole:
				rules[o.Name] = o.Rules
			case *rbacv1.ClusterRoleBinding:
				for _, s := range o.Subjects {
					bound[o.RoleRef.Name] = s.Namespace + "/" + s.Name
				}
			case *appsv1.DaemonSet:
				spec := o.Spec.Template.Spec
				agentSA = o.Namespace + "/" + spec.ServiceAccountName
				hostPaths := map[string]bool{}
				for _, v := range spec.Volumes {
					if v.HostPath != nil {
						hostPaths[v.HostPath.Path] = true
					}
				}
				for _, p := range []string{"/run/containerd/containerd.sock", "/var/lib/kubelet/pods-api"} {
					if !hostPaths[p] {
						t.Errorf("agent DaemonSet does not mount %s", p)
					}
				}
				args := spec.Containers[0].Args
				joined := strings.Join(args, " ")
				for _, want := range []string{"--node=$(NODE_NAME)", "--nkey=", "--tls-cert=", "--metrics-addr=",
					"--pod-source=kubelet", "--kubelet-pods-socket=/var/lib/kubelet/pods-api/pods-api.sock"} {
					if !strings.Contains(joined, want) {
						t.Errorf("agent args %q lack %s", joined, want)
					}
				}
				for _, a := range args[1:] {
					name, _, _ := strings.Cut(a, "=")
					if !strings.Contains(string(help), name+" ") {
						t.Errorf("agent DaemonSet: imagefleet agent has no flag %s", name)
					}
				}
				// Every default worker of this binary, and the bridge.
				m := regexp.MustCompile(`\(default: ([a-z,-]+)\)`).FindSubmatch(help)
				if m == nil {
					t.Fatalf("no default worker list in agent --help")
				}
				var workers []string
				for _, a := range args {
					if w, ok := strings.CutPrefix(a, "--workers="); ok {
						workers = strings.Split(w, ",")
					}
				}
				for _, w := range append(strings.Split(string(m[1]), ","), "kube-events") {
					if !slices.Contains(workers, w) {
						t.Errorf("agent DaemonSet workers %q lack %s", workers, w)
					}
				}
			case *appsv1.Deployment:
				for _, a := range o.Spec.Template.Spec.Containers[0].Args {
					if strings.HasPrefix(a, "--workers=") && !strings.Contains(a, "inventory") {
						t.Errorf("deployment %s runs workers %s", o.Name, a)
					}
				}
			}
		}
	}
	if kinds["DaemonSet"] != 1 || kinds["Deployment"] < 1 || kinds["ConfigMap"] != 1 {
		t.Errorf("kinds = %v, want one DaemonSet, a Deployment, one ConfigMap", kinds)
	}
	want := map[string]string{"imagefleet-agent-events": "events:create,patch", "imagefleet-agent-pods": "pods:list,watch"}
	for role, rs := range rules {
		var got []string
		for _, r := range rs {
			if !slices.Equal(r.APIGroups, []string{""}) || len(r.ResourceNames) > 0 || len(r.NonResourceURLs) > 0 {
				t.Errorf("role %s rule %+v: want core resources only", role, r)
			}
			for _, res := range r.Resources {
				got = append(got, res+":"+strings.Join(r.Verbs, ","))
			}
		}
		if strings.Join(got, " ") != want[role] {
			t.Errorf("role %s grants %q, want %q", role, got, want[role])
		}
		if bound[role] != agentSA {
			t.Errorf("role %s is bound to %q, want the agent's ServiceAccount %q", role, bound[role], agentSA)
		}
	}
	if len(rules) != len(want) {
		t.Errorf("cluster roles %v, want %v", rules, want)
	}
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
