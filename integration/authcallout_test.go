package integration_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/internal/authcallout"
)

// acNS is the namespace of the callout tests' ServiceAccounts and pods.
const acNS = "imagefleet"

// acLab is a real kube-apiserver (kubelab) with the ServiceAccounts, Nodes and pods of a deployment, a real
// nats-server in callout mode (natsconf.RenderCallout) and the callout between them, reviewing tokens with
// its own ServiceAccount's token and RBAC (create on tokenreviews, nothing more).
type acLab struct {
	t        testing.TB
	kube     *kubelab.Cluster
	admin    *kubernetes.Clientset
	nats     *natsServer
	dir      string
	pwFile   string
	issuer   string
	reviewer *kubernetes.Clientset
	logs     *bustest.SyncBuffer
	pods     map[string]*corev1.Pod
	seq      int
	stopFns  []func()
	mu       sync.Mutex
}

func startACLab(t testing.TB) *acLab {
	t.Helper()
	ctx := t.Context()
	l := &acLab{t: t, dir: t.TempDir(), logs: &bustest.SyncBuffer{}, pods: map[string]*corev1.Pod{}}
	l.kube = kubelab.StartT(t, kubelab.Options{Nodes: []string{"node-1", "node-2"}})
	var err error
	if l.admin, err = l.kube.Admin(); err != nil {
		t.Fatal(err)
	}
	if err := l.kube.PrepareNamespace(ctx, acNS); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"node-1", "node-2"} {
		if _, err := l.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", n, err)
		}
	}
	for _, sa := range []string{"imagefleet-agent", "imagefleet-operator", "imagefleet-central", "imagefleet-callout", "other"} {
		if _, err := l.admin.CoreV1().ServiceAccounts(acNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create service account %s: %v", sa, err)
		}
	}
	for _, p := range []struct{ name, node, sa string }{
		{"agent-1", "node-1", "imagefleet-agent"}, {"agent-2", "node-2", "imagefleet-agent"}, {"other-1", "node-1", "other"},
	} {
		l.pod(p.name, p.node, p.sa)
	}
	// The callout's own identity: create on tokenreviews, as the chart grants it.
	rbac := l.admin.RbacV1()
	if _, err := rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "imagefleet-auth-callout"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "imagefleet-auth-callout"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "imagefleet-auth-callout"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: acNS, Name: "imagefleet-callout"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tok := l.token("imagefleet-callout", "", nil, time.Hour)
	if l.reviewer, err = kubernetes.NewForConfig(&rest.Config{Host: l.kube.Server(), BearerToken: tok,
		TLSClientConfig: rest.TLSClientConfig{CAFile: l.kube.CAFile()},
		QPS:             authcallout.ReviewQPS, Burst: authcallout.ReviewBurst}); err != nil {
		t.Fatal(err)
	}
	// The keys as `imagefleet bus keys` keeps them (the chart's pre-install hook), and the server from the
	// callout-mode config with the issuer and password in its environment, as the chart's pods get them.
	k, err := authcallout.EnsureKeys(ctx, l.admin.CoreV1().Secrets(acNS), "imagefleet-nats-keys")
	if err != nil {
		t.Fatal(err)
	}
	sec, err := l.admin.CoreV1().Secrets(acNS).Get(ctx, "imagefleet-nats-keys", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l.issuer = k.IssuerPublic
	l.write("issuer.nk", string(sec.Data[authcallout.KeyIssuerSeed]))
	password := string(sec.Data[authcallout.KeyPassword])
	t.Setenv(natsconf.DefaultIssuerEnv, string(sec.Data[authcallout.KeyIssuerPub]))
	t.Setenv(natsconf.DefaultPasswordEnv, password)
	conf, err := natsconf.RenderCallout(natsconf.CalloutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l.nats = startNATS(t, l.write("nats.conf", string(conf)))
	l.pwFile = l.write("callout.password", password)
	return l
}

// pod creates a pod of sa bound to node (no scheduler, no kubelet: it stays Pending, which a TokenRequest
// bound to it does not mind).
func (l *acLab) pod(name, node, sa string) *corev1.Pod {
	l.t.Helper()
	p, err := l.admin.CoreV1().Pods(acNS).Create(l.t.Context(), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, Containers: []corev1.Container{{Name: "agent", Image: "imagefleet:test"}}}},
		metav1.CreateOptions{})
	if err != nil {
		l.t.Fatalf("create pod %s: %v", name, err)
	}
	l.pods[name] = p
	return p
}

// token is a TokenRequest of sa for audience (default the callout's; none: the API server's), bound to pod
// when it is given, as the kubelet asks for a projected volume's token.
func (l *acLab) token(sa, audience string, pod *corev1.Pod, ttl time.Duration) string {
	l.t.Helper()
	secs := int64(ttl / time.Second)
	spec := authnv1.TokenRequestSpec{ExpirationSeconds: &secs}
	if audience != "" {
		spec.Audiences = []string{audience}
	}
	if pod != nil {
		spec.BoundObjectRef = &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tr, err := l.admin.CoreV1().ServiceAccounts(acNS).CreateToken(l.t.Context(), sa, &authnv1.TokenRequest{Spec: spec}, metav1.CreateOptions{})
	if err != nil {
		l.t.Fatalf("token of %s: %v", sa, err)
	}
	return tr.Status.Token
}

func (l *acLab) nodeToken(pod string) string {
	return l.token("imagefleet-agent", authcallout.DefaultAudience, l.pods[pod], 10*time.Minute)
}

// write writes a file as the kubelet updates a projected volume: a new file moved into place.
func (l *acLab) write(name, content string) string {
	l.t.Helper()
	p := filepath.Join(l.dir, name)
	if err := os.WriteFile(p+".new", []byte(content), 0o600); err != nil {
		l.t.Fatal(err)
	}
	if err := os.Rename(p+".new", p); err != nil {
		l.t.Fatal(err)
	}
	return p
}

// tokenFile writes tok to a new file.
func (l *acLab) tokenFile(tok string) string {
	l.mu.Lock()
	l.seq++
	n := l.seq
	l.mu.Unlock()
	return l.write(fmt.Sprintf("token-%d", n), tok)
}

// stops are the stop functions of the replicas started so far.
func (l *acLab) stops() []func() {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.stopFns)
}

// callout runs one replica of `imagefleet bus auth-callout` as cmd builds it, until stop or the test's end;
// done is closed when Run returned.
func (l *acLab) callout() (stop func(), done <-chan struct{}) {
	l.t.Helper()
	b, err := bus.Connect(l.t.Context(), l.nats.url(), bus.Options{Name: "imagefleet-auth-callout", User: natsconf.CalloutUser,
		PasswordFile: l.pwFile, ConnectTimeout: 10 * time.Second})
	if err != nil {
		l.t.Fatalf("connect the callout: %v", err)
	}
	raw, err := os.ReadFile(filepath.Join(l.dir, "issuer.nk"))
	if err != nil {
		l.t.Fatal(err)
	}
	kp, err := authcallout.LoadIssuer(raw)
	if err != nil {
		l.t.Fatal(err)
	}
	svc, err := authcallout.New(authcallout.Config{Issuer: kp,
		NodeServiceAccount: authcallout.ServiceAccount{Namespace: acNS, Name: "imagefleet-agent"},
		Roles: []authcallout.RoleBinding{
			{Role: natsconf.RoleAdmin, ServiceAccount: authcallout.ServiceAccount{Namespace: acNS, Name: "imagefleet-operator"}},
			{Role: natsconf.RoleCentral, ServiceAccount: authcallout.ServiceAccount{Namespace: acNS, Name: "imagefleet-central"}},
		},
		Logger: slog.New(slog.NewTextHandler(l.logs, nil)),
	}, l.reviewer.AuthenticationV1().TokenReviews(), b)
	if err != nil {
		l.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan struct{})
	var runErr error
	go func() { runErr = svc.Run(ctx); close(ended) }()
	select {
	case <-svc.Ready():
	case <-ended:
		l.t.Fatalf("callout Run: %v", runErr)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-ended:
				if runErr != nil {
					l.t.Errorf("callout Run: %v", runErr)
				}
			case <-time.After(bustest.StopTimeout):
				l.t.Error("callout Run did not return after cancel")
			}
			b.Close()
			kp.Wipe()
		})
	}
	l.t.Cleanup(stop)
	l.mu.Lock()
	l.stopFns = append(l.stopFns, stop)
	l.mu.Unlock()
	return stop, ended
}

func (l *acLab) connect(o bus.Options) (*bus.Bus, error) {
	o.Name, o.ConnectTimeout = "test-client", 10*time.Second
	b, err := bus.Connect(l.t.Context(), l.nats.url(), o)
	if err == nil {
		l.t.Cleanup(b.Close)
	}
	return b, err
}

func (l *acLab) mustConnect(what, tokFile string) *bus.Bus {
	l.t.Helper()
	b, err := l.connect(bus.Options{TokenFile: tokFile})
	if err != nil {
		l.t.Fatalf("%s: %v", what, err)
	}
	return b
}

// wantRefused checks that a connect with o was refused by the server (not unreachable), with an error
// that does not quote the token, and that the callout logged reason (and not the token).
func (l *acLab) wantRefused(t *testing.T, o bus.Options, tok, reason string) {
	t.Helper()
	_, err := l.connect(o)
	if err == nil {
		t.Fatalf("connected; want refused with %q", reason)
	}
	if bus.IsUnreachable(err) {
		t.Errorf("error %v: want a refusal, not unreachable", err)
	}
	if tok != "" && strings.Contains(err.Error(), tok) {
		t.Error("the error quotes the token")
	}
	if reason != "" {
		bustest.WaitFor(t, "the callout logs "+reason, func() bool { return strings.Contains(l.logs.String(), reason) })
	}
	if tok != "" && strings.Contains(l.logs.String(), tok) {
		t.Error("the token is in the callout's log")
	}
}

// jti is the token's id, as the callout logs it (credential_id).
func jti(t testing.TB, tok string) string {
	t.Helper()
	parts := strings.Split(tok, ".")
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		JTI string `json:"jti"`
	}
	if err := json.Unmarshal(raw, &c); err != nil || c.JTI == "" {
		t.Fatalf("token without jti: %v", err)
	}
	return c.JTI
}

// TestAuthCalloutKubernetes: node identity with nothing on the host. Pod-bound ServiceAccount tokens from
// a real API server let each agent in as its own node and nothing else; every other token is refused with
// its reason in the callout's log; a rotated token is read at reconnect; the callout survives its API
// server's absence and its own.
func TestAuthCalloutKubernetes(t *testing.T) {
	l := startACLab(t)
	l.callout()
	tok1 := l.nodeToken("agent-1")
	node1 := l.mustConnect("node-1's token", l.tokenFile(tok1))
	node2 := l.mustConnect("node-2's token", l.tokenFile(l.nodeToken("agent-2")))
	operator := l.mustConnect("the operator's token (kubectl create token, bound to nothing)",
		l.tokenFile(l.token("imagefleet-operator", authcallout.DefaultAudience, nil, 10*time.Minute)))
	central := l.mustConnect("the central workers' token",
		l.tokenFile(l.token("imagefleet-central", authcallout.DefaultAudience, nil, 10*time.Minute)))

	t.Run("each node gets its own subjects", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		seen, err := operator.SubscribeSync(ctx, events.Prefix+".evt.>")
		if err != nil {
			t.Fatal(err)
		}
		defer seen.Close()
		for node, b := range map[string]*bus.Bus{"node-1": node1, "node-2": node2} {
			own := events.EventSubject(node, "image", "added")
			if err := b.PublishRaw(own, []byte("{}")); err != nil {
				t.Fatal(err)
			}
			if subj, _, err := seen.Next(ctx); err != nil || subj != own {
				t.Errorf("the operator saw %q, %v; want %s", subj, err, own)
			}
		}
		// The central workers query node-1, which answers through its own inbox and theirs.
		qry := events.QuerySubject("node-1", "ping")
		l, err := node1.Listen(ctx, qry, "", 1, func(context.Context, []byte) (any, error) { return "pong", nil })
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = l.Serve(ctx) }()
		var got string
		if err := central.Request(ctx, qry, "ping", &got); err != nil || got != "pong" {
			t.Errorf("central asking node-1: %q, %v", got, err)
		}
		if err := node1.Request(ctx, qry, "ping", &got); err != nil || got != "pong" {
			t.Errorf("node-1 asking itself: %q, %v", got, err)
		}
		// Node A on node B's subjects: refused by construction (the permissions come from A's token).
		for _, subj := range []string{events.EventSubject("node-2", "image", "added"), events.CommandSubject("node-2", "gc"),
			"$KV." + events.RecordsBucket + ".node-2.x"} {
			if err := node1.PublishRaw(subj, []byte("{}")); err != nil {
				t.Fatal(err)
			}
			waitViolation(t, node1, subj)
		}
		for _, subj := range []string{events.Prefix + ".cmd.node-2.>", "_INBOX.>", events.Prefix + ".fleet.>"} {
			sub, err := node1.SubscribeSync(ctx, subj)
			if err == nil {
				defer sub.Close()
			}
			waitViolation(t, node1, subj)
		}
	})

	t.Run("refusals", func(t *testing.T) {
		gone := l.pod("agent-gone", "node-1", "imagefleet-agent")
		goneTok := l.nodeToken("agent-gone")
		goneFile := l.tokenFile(goneTok)
		l.mustConnect("the pod's token before its deletion", goneFile)
		grace := int64(0)
		if err := l.admin.CoreV1().Pods(acNS).Delete(t.Context(), gone.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
			t.Fatal(err)
		}
		other := l.token("other", authcallout.DefaultAudience, l.pods["other-1"], 10*time.Minute)
		otherAud := l.token("imagefleet-agent", "other", l.pods["agent-1"], 10*time.Minute)
		apiAud := l.token("imagefleet-agent", "", l.pods["agent-1"], 10*time.Minute)
		unbound := l.token("imagefleet-agent", authcallout.DefaultAudience, nil, 10*time.Minute)
		// The API server keeps a token's successful review for 10 s (its token cache): the pod's deletion
		// shows within that.
		bustest.Eventually(t, "the deleted pod's token refused", 20*time.Second, func() error {
			b, err := l.connect(bus.Options{TokenFile: goneFile})
			if err == nil {
				b.Close()
				return errors.New("still accepted")
			}
			return nil
		})
		l.wantRefused(t, bus.Options{TokenFile: goneFile}, goneTok, "service account token has been invalidated")
		for _, tc := range []struct {
			name, tok, reason string
			opts              bus.Options
		}{
			{name: "a token of another service account", tok: other, reason: "service account has no role here: imagefleet/other"},
			{name: "a token for another audience", tok: otherAud, reason: `token audiences [\"other\"] is invalid for the target audiences [\"imagefleet-nats\"]`},
			{name: "a token for the API server", tok: apiAud, reason: "is invalid for the target audiences"},
			{name: "a node token bound to no pod", tok: unbound, reason: "node service account token is not bound to a pod: imagefleet/imagefleet-agent"},
			{name: "not a token", tok: "not-a-token", reason: "token refused by the API server"},
			{name: "no token and no user", opts: bus.Options{}, reason: `reason="no token`},
			{name: "the callout's user with a wrong password", opts: bus.Options{User: natsconf.CalloutUser, PasswordFile: l.write("wrong", "pwrong")}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				o := tc.opts
				if tc.tok != "" && o.TokenFile == "" {
					o.TokenFile = l.tokenFile(tc.tok)
				}
				l.wantRefused(t, o, tc.tok, tc.reason)
			})
		}
	})

	t.Run("a rotated token is read at reconnect", func(t *testing.T) {
		file := l.tokenFile(l.nodeToken("agent-1"))
		b := l.mustConnect("agent-1's first token", file)
		next := l.nodeToken("agent-1") // the kubelet's next token for the same pod
		l.write(filepath.Base(file), next)
		l.nats.stop()
		l.nats.start()
		bustest.WaitFor(t, "the next token used", func() bool {
			return strings.Contains(l.logs.String(), `credential_id="JTI=`+jti(t, next)+`"`) && b.Connected()
		})
		// A bad token in the file is refused at the next reconnect; the client keeps trying and is back on its
		// own once a good one is there.
		bad := l.token("imagefleet-agent", "other", l.pods["agent-1"], 10*time.Minute)
		l.write(filepath.Base(file), bad)
		refusals := strings.Count(l.logs.String(), "is invalid for the target audiences")
		l.nats.stop()
		l.nats.start()
		bustest.WaitFor(t, "the bad token refused", func() bool {
			return strings.Count(l.logs.String(), "is invalid for the target audiences") > refusals
		})
		last := l.nodeToken("agent-1")
		l.write(filepath.Base(file), last)
		bustest.WaitFor(t, "back with the last token", func() bool {
			return strings.Contains(l.logs.String(), `credential_id="JTI=`+jti(t, last)+`"`) && b.Connected()
		})
		own := events.EventSubject("node-1", "image", "added")
		if err := b.PublishRaw(own, []byte("{}")); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if err := b.Flush(ctx); err != nil || b.PermissionViolation(own) != nil {
			t.Errorf("publishing its own event after the rotation: %v, %v", err, b.PermissionViolation(own))
		}
	})

	t.Run("the API server away and back", func(t *testing.T) {
		file := l.tokenFile(tok1)
		_, done := l.callout() // a second replica: both must live through it
		l.kube.StopAPIServer(5 * time.Second)
		l.wantRefused(t, bus.Options{TokenFile: file}, tok1, `reason="token review failed: `)
		select {
		case <-done:
			t.Fatal("the callout stopped without its API server")
		default:
		}
		if err := l.kube.StartAPIServer(t.Context()); err != nil {
			t.Fatal(err)
		}
		bustest.Eventually(t, "a connect once the API server is back", 30*time.Second, func() error {
			b, err := l.connect(bus.Options{TokenFile: file})
			if err == nil {
				b.Close()
			}
			return err
		})
	})

	t.Run("the callout away and back", func(t *testing.T) {
		file := l.tokenFile(l.nodeToken("agent-2"))
		// Every replica started so far (the first and the API-server subtest's) stops.
		for _, stop := range l.stops() {
			stop()
		}
		_, err := l.connect(bus.Options{TokenFile: file})
		if err == nil || bus.IsUnreachable(err) || !strings.Contains(err.Error(), "auth callout") {
			t.Fatalf("no callout: %v, want a refusal naming the callout", err)
		}
		l.callout()
		l.mustConnect("the callout back", file)
	})
}

// kubeconfigFor writes a kubeconfig that authenticates to the lab's API server with token.
func (l *acLab) kubeconfigFor(name, token string) string {
	return l.write(name+".kubeconfig", fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster: {server: %s, certificate-authority: %s}
users:
- name: %s
  user: {token: %s}
contexts:
- name: lab
  context: {cluster: lab, user: %s, namespace: %s}
current-context: lab
`, l.kube.Server(), l.kube.CAFile(), name, token, name, acNS))
}

// run runs the imagefleet binary to its end, with its combined output.
func acRun(t *testing.T, bin string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	return string(out), err
}

// TestAuthCalloutCommands runs the commands as the Helm chart does, each with the RBAC it documents:
// `bus keys` in a hook Job (get and create on secrets), `bus auth-callout` with the global NATS flags of
// an auth user (create on tokenreviews), and the operator's path in docs/security.md: a token from
// `kubectl create token` in --token-file for `bus init` and `fleet nodes`.
func TestAuthCalloutCommands(t *testing.T) {
	bin := imagefleetBinary(t)
	l := startACLab(t)
	ctx := t.Context()
	// The hook Job's identity: get on its Secrets by name, create (which RBAC cannot narrow by name).
	if _, err := l.admin.CoreV1().ServiceAccounts(acNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "keys-job"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.admin.RbacV1().Roles(acNS).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "keys-job"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"secrets"}, ResourceNames: []string{"imagefleet-nats-keys", "fresh-keys"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"create"}},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.admin.RbacV1().RoleBindings(acNS).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "keys-job"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "keys-job"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: acNS, Name: "keys-job"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	jobKC := l.kubeconfigFor("keys-job", l.token("keys-job", "", nil, time.Hour))
	before, err := l.admin.CoreV1().Secrets(acNS).Get(ctx, "imagefleet-nats-keys", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ secret, want string }{
		{"imagefleet-nats-keys", "secret imagefleet/imagefleet-nats-keys kept; issuer " + l.issuer},
		{"fresh-keys", "secret imagefleet/fresh-keys created; issuer A"},
		{"fresh-keys", "secret imagefleet/fresh-keys kept; issuer A"},
	} {
		out, err := acRun(t, bin, "bus", "keys", "--secret", tc.secret, "--kubeconfig", jobKC)
		if err != nil || !strings.HasPrefix(out, tc.want) {
			t.Errorf("bus keys --secret %s: %v\n%s\nwant %q", tc.secret, err, out, tc.want)
		}
		sec, err := l.admin.CoreV1().Secrets(acNS).Get(ctx, tc.secret, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{authcallout.KeyIssuerSeed, authcallout.KeyPassword} {
			if v := strings.TrimSpace(string(sec.Data[k])); v == "" || strings.Contains(out, v) {
				t.Errorf("%s: %s empty or printed", tc.secret, k)
			}
		}
	}
	after, err := l.admin.CoreV1().Secrets(acNS).Get(ctx, "imagefleet-nats-keys", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if after.ResourceVersion != before.ResourceVersion {
		t.Error("bus keys changed a complete Secret")
	}

	// The callout as the chart runs it.
	if _, err := l.admin.CoreV1().ServiceAccounts(acNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "no-rbac"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	calloutKC := l.kubeconfigFor("imagefleet-callout", l.token("imagefleet-callout", "", nil, time.Hour))
	callout := startProc(t, "auth-callout", bin, "--nats", l.nats.url(), "--user", natsconf.CalloutUser, "--password-file", l.pwFile,
		"bus", "auth-callout", "--issuer-seed-file", filepath.Join(l.dir, "issuer.nk"), "--kubeconfig", calloutKC,
		"--node-service-account", acNS+"/imagefleet-agent", "--role", "admin="+acNS+"/imagefleet-operator",
		"--role", "central="+acNS+"/imagefleet-central")
	bustest.WaitFor(t, "the callout ready", func() bool { return strings.Contains(tail(callout.log, 20), "auth callout ready") })

	// The operator: kubectl create token imagefleet-operator --audience imagefleet-nats > tok.
	op := l.tokenFile(l.token("imagefleet-operator", authcallout.DefaultAudience, nil, 10*time.Minute))
	for _, args := range [][]string{{"bus", "init"}, {"fleet", "nodes"}} {
		out, err := acRun(t, bin, append([]string{"--nats", l.nats.url(), "--token-file", op, "--timeout", "20s"}, args...)...)
		if err != nil {
			t.Errorf("imagefleet --token-file tok %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	other := l.tokenFile(l.token("other", authcallout.DefaultAudience, nil, 10*time.Minute))
	out, err := acRun(t, bin, "--nats", l.nats.url(), "--token-file", other, "--timeout", "10s", "fleet", "nodes")
	if err == nil || !strings.Contains(out, "auth callout") {
		t.Errorf("another service account's token: %v\n%s\nwant a refusal naming the callout", err, out)
	}
	if log := tail(callout.log, 50); !strings.Contains(log, "service account has no role here: imagefleet/other") {
		t.Errorf("the callout's log lacks the refusal:\n%s", log)
	}

	// Without create on tokenreviews, the callout refuses every token and says why.
	noRBAC := startProc(t, "auth-callout-no-rbac", bin, "--nats", l.nats.url(), "--user", natsconf.CalloutUser, "--password-file", l.pwFile,
		"bus", "auth-callout", "--issuer-seed-file", filepath.Join(l.dir, "issuer.nk"),
		"--kubeconfig", l.kubeconfigFor("no-rbac", l.token("no-rbac", "", nil, time.Hour)),
		"--node-service-account", acNS+"/imagefleet-agent")
	bustest.WaitFor(t, "the second callout ready", func() bool { return strings.Contains(tail(noRBAC.log, 20), "auth callout ready") })
	callout.stop(syscall.SIGTERM)
	if _, err := l.connect(bus.Options{TokenFile: l.tokenFile(l.nodeToken("agent-1"))}); err == nil {
		t.Error("connected through a callout that may not review tokens")
	}
	if log := tail(noRBAC.log, 20); !strings.Contains(log, "token review failed") || !strings.Contains(log, "forbidden") {
		t.Errorf("the callout without RBAC does not say why:\n%s", log)
	}
}
