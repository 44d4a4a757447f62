package authcallout_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/authcallout"
)

const (
	ns      = "imagefleet"
	agentSA = "imagefleet-agent"
)

// token is a JWT-shaped token with these claims; the fake API server decides whether it is good.
func token(t testing.TB, claims map[string]any) string {
	t.Helper()
	raw, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc(raw) + ".c2ln"
}

// podToken is the claims of a token bound to pod uid on node.
func podClaims(jti, podUID string, exp time.Time) map[string]any {
	return map[string]any{"jti": jti, "exp": exp.Unix(), "kubernetes.io": map[string]any{"pod": map[string]any{"uid": podUID}}}
}

// fakeAPI is the API server's TokenReview: it accepts the tokens it was told about with their status, and
// is down while down is set.
type fakeAPI struct {
	mu       sync.Mutex
	statuses map[string]authnv1.TokenReviewStatus
	down     bool
	reviewed []string // tokens asked about, in order
}

func (f *fakeAPI) Create(_ context.Context, tr *authnv1.TokenReview, _ metav1.CreateOptions) (*authnv1.TokenReview, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reviewed = append(f.reviewed, tr.Spec.Token)
	if f.down {
		return nil, errors.New(`Post "https://127.0.0.1:6443/apis/authentication.k8s.io/v1/tokenreviews": dial tcp 127.0.0.1:6443: connect: connection refused`)
	}
	st, ok := f.statuses[tr.Spec.Token]
	if !ok {
		st = authnv1.TokenReviewStatus{Error: "[invalid bearer token, square/go-jose: error in cryptographic primitive]"}
	}
	out := tr.DeepCopy()
	out.Status = st
	return out, nil
}

func (f *fakeAPI) set(tok string, st authnv1.TokenReviewStatus) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.statuses == nil {
		f.statuses = map[string]authnv1.TokenReviewStatus{}
	}
	f.statuses[tok] = st
}

func (f *fakeAPI) setDown(down bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.down = down
}

func (f *fakeAPI) wasReviewed(tok string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.reviewed {
		if r == tok {
			return true
		}
	}
	return false
}

// accepted is the status the API server gives a token of sa, bound to pod on node when pod is set.
func accepted(sa, node, pod string) authnv1.TokenReviewStatus {
	st := authnv1.TokenReviewStatus{Authenticated: true, Audiences: []string{authcallout.DefaultAudience},
		User: authnv1.UserInfo{Username: "system:serviceaccount:" + ns + ":" + sa, Extra: map[string]authnv1.ExtraValue{}}}
	if pod != "" {
		st.User.Extra["authentication.kubernetes.io/node-name"] = authnv1.ExtraValue{node}
		st.User.Extra["authentication.kubernetes.io/pod-name"] = authnv1.ExtraValue{pod}
		st.User.Extra["authentication.kubernetes.io/credential-id"] = authnv1.ExtraValue{"JTI=" + pod}
	}
	return st
}

func issuer(t testing.TB) nkeys.KeyPair {
	t.Helper()
	kp, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	return kp
}

func baseConfig(t testing.TB, log *slog.Logger) authcallout.Config {
	return authcallout.Config{Issuer: issuer(t), NodeServiceAccount: authcallout.ServiceAccount{Namespace: ns, Name: agentSA},
		Roles:  []authcallout.RoleBinding{{Role: natsconf.RoleAdmin, ServiceAccount: authcallout.ServiceAccount{Namespace: ns, Name: "operator"}}},
		Logger: log}
}

func TestConfigIsValidated(t *testing.T) {
	sa := func(name string) authcallout.ServiceAccount {
		return authcallout.ServiceAccount{Namespace: ns, Name: name}
	}
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		edit func(*authcallout.Config)
		want string
	}{
		{"no issuer", func(c *authcallout.Config) { c.Issuer = nil }, "auth callout: no issuer key"},
		{"user key as issuer", func(c *authcallout.Config) { c.Issuer = user }, "auth callout: the issuer key is not an account nkey (a seed starting with SA)"},
		{"nobody let in", func(c *authcallout.Config) { c.NodeServiceAccount, c.Roles = authcallout.ServiceAccount{}, nil },
			"auth callout: no node service account and no role: every token would be refused"},
		{"unknown role", func(c *authcallout.Config) {
			c.Roles = []authcallout.RoleBinding{{Role: "root", ServiceAccount: sa("x")}}
		},
			"auth callout: unknown role \"root\", want one of fleet, inventory, central, admin"},
		{"two roles", func(c *authcallout.Config) {
			c.Roles = append(c.Roles, authcallout.RoleBinding{Role: natsconf.RoleFleet, ServiceAccount: sa("operator")})
		}, "auth callout: service account imagefleet/operator is given two roles, admin and fleet: give it one (central is fleet and inventory)"},
		{"node and role", func(c *authcallout.Config) { c.Roles[0].ServiceAccount = sa(agentSA) },
			"auth callout: service account imagefleet/imagefleet-agent is given two roles, node and admin"},
		{"short TTL", func(c *authcallout.Config) { c.MaxTTL = time.Millisecond }, "auth callout: max TTL 1ms: want at least 1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := baseConfig(t, nil)
			tc.edit(&cfg)
			_, err := authcallout.New(cfg, &fakeAPI{}, nil)
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("New: %v, want %q", err, tc.want)
			}
		})
	}
	for _, tc := range []struct{ in, want string }{
		{"fleet", `role "fleet": want ROLE=NAMESPACE/NAME, ROLE one of fleet, inventory, central, admin`},
		{"root=a/b", `role "root=a/b": unknown role "root"`},
		{"admin=a", `role "admin=a": service account "a": want NAMESPACE/NAME`},
		{"admin=a/b/c", `role "admin=a/b/c": service account "a/b/c": want NAMESPACE/NAME`},
	} {
		if _, err := authcallout.ParseRoleBinding(tc.in); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("ParseRoleBinding(%q): %v, want %q", tc.in, err, tc.want)
		}
	}
	if rb, err := authcallout.ParseRoleBinding("central=imagefleet/central"); err != nil || rb.Role != natsconf.RoleCentral || rb.ServiceAccount != sa("central") {
		t.Errorf("ParseRoleBinding(central=imagefleet/central) = %+v, %v", rb, err)
	}
}

// request is an authorization request as the server signs it, for the user key it made for a connection.
func request(t testing.TB, server nkeys.KeyPair, userKey, tok string) []byte {
	t.Helper()
	spub, _ := server.PublicKey()
	rc := jwt.NewAuthorizationRequestClaims(spub)
	rc.Audience = "nats-authorization-request"
	rc.UserNkey = userKey
	rc.Server = jwt.ServerID{Name: "test", ID: spub}
	rc.ConnectOptions.Token = tok
	rc.Expires = time.Now().Add(2 * time.Second).Unix()
	out, err := rc.Encode(server)
	if err != nil {
		t.Fatal(err)
	}
	return []byte(out)
}

// answer decodes the callout's response: the user it lets in, or its reason.
func answer(t testing.TB, raw []byte, issuerPub, serverID, userKey string) (*jwt.UserClaims, string) {
	t.Helper()
	rc, err := jwt.DecodeAuthorizationResponseClaims(string(raw))
	if err != nil {
		t.Fatalf("decode response: %v", err)
	}
	if rc.Issuer != issuerPub || rc.Audience != serverID || rc.Subject != userKey {
		t.Fatalf("response issuer %s audience %s subject %s, want %s %s %s", rc.Issuer, rc.Audience, rc.Subject, issuerPub, serverID, userKey)
	}
	if rc.Error != "" {
		return nil, rc.Error
	}
	uc, err := jwt.DecodeUserClaims(rc.Jwt)
	if err != nil {
		t.Fatalf("decode user: %v", err)
	}
	return uc, ""
}

// TestAuthorize calls the handler directly: what each token gets, how long, and each refusal's reason.
func TestAuthorize(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	api := &fakeAPI{}
	var logs bustest.SyncBuffer
	cfg := baseConfig(t, slog.New(slog.NewTextHandler(&logs, nil)))
	cfg.Now = func() time.Time { return now }
	cfg.MaxTTL = time.Hour
	cfg.Roles = append(cfg.Roles, authcallout.RoleBinding{Role: natsconf.RoleCentral, ServiceAccount: authcallout.ServiceAccount{Namespace: ns, Name: "central"}})
	svc, err := authcallout.New(cfg, api, nil)
	if err != nil {
		t.Fatal(err)
	}
	ipub, _ := cfg.Issuer.PublicKey()
	server, err := nkeys.CreateServer()
	if err != nil {
		t.Fatal(err)
	}
	spub, _ := server.PublicKey()

	node1 := token(t, podClaims("j1", "uid-1", now.Add(10*time.Minute)))
	api.set(node1, accepted(agentSA, "node-1", "agent-1"))
	long := token(t, podClaims("j2", "uid-2", now.Add(48*time.Hour)))
	api.set(long, accepted(agentSA, "node-2", "agent-2"))
	operator := token(t, map[string]any{"jti": "op-1", "exp": now.Add(30 * time.Minute).Unix()})
	api.set(operator, accepted("operator", "", ""))
	central := token(t, map[string]any{"jti": "c-1", "exp": now.Add(30 * time.Minute).Unix()})
	api.set(central, accepted("central", "", ""))
	other := token(t, podClaims("j3", "uid-3", now.Add(10*time.Minute)))
	api.set(other, accepted("someone-else", "node-1", "x"))
	unbound := token(t, map[string]any{"jti": "j4", "exp": now.Add(10 * time.Minute).Unix()})
	api.set(unbound, accepted(agentSA, "", ""))
	legacy := token(t, map[string]any{"sub": "system:serviceaccount:imagefleet:operator"})
	api.set(legacy, accepted("operator", "", ""))
	badNode := token(t, podClaims("j5", "uid-5", now.Add(10*time.Minute)))
	api.set(badNode, accepted(agentSA, "Node_1", "p"))
	deleted := token(t, podClaims("j6", "uid-6", now.Add(10*time.Minute)))
	api.set(deleted, authnv1.TokenReviewStatus{Error: "[invalid bearer token, service account token has been invalidated]"})
	noAud := token(t, podClaims("j7", "uid-7", now.Add(10*time.Minute)))
	st := accepted(agentSA, "node-1", "agent-1")
	st.Audiences = nil
	api.set(noAud, st)
	notSA := token(t, podClaims("j8", "uid-8", now.Add(10*time.Minute)))
	st = accepted(agentSA, "node-1", "agent-1")
	st.User.Username = "alice"
	api.set(notSA, st)

	for _, tc := range []struct {
		name, tok string
		// wantExp: the user's expiry; wantPub and wantNot: subjects it may and may not publish to.
		wantExp         time.Time
		wantPub, notPub []string
		wantSub         []string
		// refused: a prefix of the reason.
		refused string
	}{
		{name: "node token", tok: node1, wantExp: now.Add(10 * time.Minute),
			wantPub: []string{events.EventSubject("node-1", "image", "added")}, notPub: []string{events.EventSubject("node-2", "image", "added"), ">"},
			wantSub: []string{"_INBOX.uid-1.>", events.Prefix + ".cmd.node-1.>"}},
		{name: "bounded by max TTL", tok: long, wantExp: now.Add(time.Hour),
			wantPub: []string{events.EventSubject("node-2", "image", "added")}, notPub: []string{events.EventSubject("node-1", "image", "added")}},
		{name: "admin role, unbound", tok: operator, wantExp: now.Add(30 * time.Minute), wantPub: []string{">"}, wantSub: []string{">"}},
		{name: "central role", tok: central, wantExp: now.Add(30 * time.Minute),
			wantPub: []string{events.Prefix + ".cmd.>", "$KV." + events.InventoryBucket + ".>"}, notPub: []string{">"},
			wantSub: []string{"_INBOX.c-1.>", events.InventoryQuerySubject}},
		{name: "no token", tok: "", refused: "no token"},
		{name: "not a token", tok: "garbage", refused: "token refused by the API server: [invalid bearer token"},
		{name: "deleted pod", tok: deleted, refused: "token refused by the API server: [invalid bearer token, service account token has been invalidated]"},
		{name: "audience not confirmed", tok: noAud, refused: `token refused by the API server: the API server did not confirm audience "imagefleet-nats"`},
		{name: "another service account", tok: other, refused: "service account has no role here: imagefleet/someone-else"},
		{name: "not a service account", tok: notSA, refused: `service account has no role here: "alice" is not a service account`},
		{name: "node token not bound to a pod", tok: unbound, refused: "node service account token is not bound to a pod: imagefleet/imagefleet-agent's token names no node and pod"},
		{name: "legacy token without expiry", tok: legacy, refused: "token unusable: token has no expiry"},
		{name: "invalid node name", tok: badNode, refused: `token unusable: node name "Node_1" is not a DNS-1123 subdomain`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ukp, _ := nkeys.CreateUser()
			upub, _ := ukp.PublicKey()
			uc, reason := answer(t, svc.Authorize(t.Context(), request(t, server, upub, tc.tok)), ipub, spub, upub)
			if tc.refused != "" {
				if !strings.HasPrefix(reason, tc.refused) {
					t.Errorf("reason %q, want %q", reason, tc.refused)
				}
				return
			}
			if reason != "" {
				t.Fatalf("refused: %s", reason)
			}
			if uc.Issuer != ipub || uc.Audience != natsconf.Account {
				t.Errorf("user issuer %s account %s, want %s %s", uc.Issuer, uc.Audience, ipub, natsconf.Account)
			}
			if got := time.Unix(uc.Expires, 0); !got.Equal(tc.wantExp) {
				t.Errorf("user expires %s, want %s", got.UTC(), tc.wantExp)
			}
			for _, s := range tc.wantPub {
				if !uc.Pub.Allow.Contains(s) && !matches(uc.Pub.Allow, s) {
					t.Errorf("may not publish %s", s)
				}
			}
			for _, s := range tc.notPub {
				if matches(uc.Pub.Allow, s) {
					t.Errorf("may publish %s", s)
				}
			}
			for _, s := range tc.wantSub {
				if !uc.Sub.Allow.Contains(s) {
					t.Errorf("may not subscribe %s (has %v)", s, uc.Sub.Allow)
				}
			}
			if !uc.AllowedConnectionTypes.Contains(jwt.ConnectionTypeStandard) || len(uc.AllowedConnectionTypes) != 1 {
				t.Errorf("connection types %v, want STANDARD only", uc.AllowedConnectionTypes)
			}
		})
	}
	out := logs.String()
	for _, tok := range []string{node1, long, operator, deleted, other, unbound} {
		if strings.Contains(out, tok) || strings.Contains(out, strings.Split(tok, ".")[1]) {
			t.Errorf("a token is in the log")
		}
	}
	for _, want := range []string{`msg="auth callout refused"`, `reason="service account has no role here: imagefleet/someone-else"`,
		`msg="auth callout accepted"`, `service_account=imagefleet/imagefleet-agent role=node node=node-1 pod=agent-1 credential_id="JTI=agent-1"`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
	// A request that is not a server's is not answered (the server times its client out).
	if got := svc.Authorize(t.Context(), []byte("not a jwt")); got != nil {
		t.Errorf("answered garbage: %s", got)
	}
}

// matches reports whether subject s is covered by one of the patterns (NATS wildcards).
func matches(patterns jwt.StringList, s string) bool {
	for _, p := range patterns {
		pt, st := strings.Split(p, "."), strings.Split(s, ".")
		ok := true
		for i := range pt {
			if pt[i] == ">" {
				break
			}
			if i >= len(st) || (pt[i] != "*" && pt[i] != st[i]) {
				ok = false
				break
			}
			if i == len(pt)-1 && len(st) != len(pt) {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// lab is a real nats-server in callout mode (the config natsconf.RenderCallout writes) and a callout in front
// of a fake API server.
type lab struct {
	t       *testing.T
	url     string
	dir     string
	api     *fakeAPI
	logs    *bustest.SyncBuffer
	cfg     authcallout.Config
	pwFile  string
	mu      sync.Mutex
	stopAll []func()
}

func startLab(t *testing.T, maxTTL time.Duration) *lab {
	t.Helper()
	l := &lab{t: t, dir: t.TempDir(), api: &fakeAPI{}, logs: &bustest.SyncBuffer{}}
	l.cfg = baseConfig(t, slog.New(slog.NewTextHandler(l.logs, nil)))
	l.cfg.MaxTTL = maxTTL
	pub, _ := l.cfg.Issuer.PublicKey()
	const password = "p0123456789abcdef"
	t.Setenv(natsconf.DefaultIssuerEnv, pub)
	t.Setenv(natsconf.DefaultPasswordEnv, password)
	conf, err := natsconf.RenderCallout(natsconf.CalloutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	file := l.write("nats.conf", string(conf))
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: file, Listen: "127.0.0.1:-1", StoreDir: filepath.Join(l.dir, "js")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	l.url = srv.ClientURL()
	l.pwFile = l.write("callout.password", password)
	return l
}

func (l *lab) write(name, content string) string {
	l.t.Helper()
	p := filepath.Join(l.dir, name)
	if err := os.WriteFile(p+".tmp", []byte(content+"\n"), 0o600); err != nil {
		l.t.Fatal(err)
	}
	if err := os.Rename(p+".tmp", p); err != nil { // as the kubelet swaps a projected volume's files
		l.t.Fatal(err)
	}
	return p
}

// startCallout runs one replica until the returned stop is called (or the test ends).
func (l *lab) startCallout() (stop func()) {
	l.t.Helper()
	b, err := bus.Connect(l.t.Context(), l.url, bus.Options{Name: "callout", User: natsconf.CalloutUser, PasswordFile: l.pwFile,
		ConnectTimeout: 5 * time.Second})
	if err != nil {
		l.t.Fatalf("connect the callout: %v", err)
	}
	svc, err := authcallout.New(l.cfg, l.api, b)
	if err != nil {
		l.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	select {
	case <-svc.Ready():
	case err := <-done:
		l.t.Fatalf("callout Run: %v", err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					l.t.Errorf("callout Run: %v", err)
				}
			case <-time.After(bustest.StopTimeout):
				l.t.Error("callout Run did not return after cancel")
			}
			b.Close()
		})
	}
	l.t.Cleanup(stop)
	return stop
}

func (l *lab) connect(tokFile string) (*bus.Bus, error) {
	b, err := bus.Connect(l.t.Context(), l.url, bus.Options{Name: "client", TokenFile: tokFile, ConnectTimeout: 5 * time.Second})
	if err == nil {
		l.t.Cleanup(b.Close)
	}
	return b, err
}

// TestNodeConnectsAsItsNode: through a real server, node-1's token gets node-1's subjects and its own
// inbox (a request to itself is answered), and node-2's subjects are refused.
func TestNodeConnectsAsItsNode(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	l := startLab(t, time.Hour)
	exp := time.Now().Add(10 * time.Minute)
	tok := token(t, podClaims("j1", "uid-1", exp))
	l.api.set(tok, accepted(agentSA, "node-1", "agent-1"))
	op := token(t, map[string]any{"jti": "op-1", "exp": exp.Unix()})
	l.api.set(op, accepted("operator", "", ""))
	l.startCallout()
	node, err := l.connect(l.write("node-1.token", tok))
	if err != nil {
		t.Fatalf("node-1: %v", err)
	}
	admin, err := l.connect(l.write("operator.token", op))
	if err != nil {
		t.Fatalf("operator: %v", err)
	}
	seen, err := admin.SubscribeSync(t.Context(), events.Prefix+".evt.>")
	if err != nil {
		t.Fatal(err)
	}
	own := events.EventSubject("node-1", "image", "added")
	if err := node.PublishRaw(own, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if subj, _, err := seen.Next(ctx); err != nil || subj != own {
		t.Errorf("the operator saw %q, %v; want node-1's event on %s", subj, err, own)
	}
	// Its own query, answered through its own inbox.
	qry := events.QuerySubject("node-1", "ping")
	go func() {
		_ = node.Serve(ctx, qry, "", func(context.Context, []byte) (any, error) { return "pong", nil })
	}()
	bustest.Eventually(t, "node-1 answers itself", 5*time.Second, func() error {
		var got string
		rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer rcancel()
		if err := node.Request(rctx, qry, "ping", &got); err != nil {
			return err
		}
		if got != "pong" {
			return fmt.Errorf("answer %q", got)
		}
		return nil
	})
	other := events.EventSubject("node-2", "image", "added")
	if err := node.PublishRaw(other, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	waitViolation(t, node, other)
	theirs := events.Prefix + ".cmd.node-2.>"
	sub, err := node.SubscribeSync(t.Context(), theirs)
	if err == nil {
		defer sub.Close()
	}
	waitViolation(t, node, theirs)
	cancel()
}

func waitViolation(t *testing.T, b *bus.Bus, subject string) {
	t.Helper()
	bustest.Eventually(t, "a permissions violation on "+subject, 5*time.Second, func() error {
		if err := b.PermissionViolation(subject); err == nil {
			return errors.New("none yet")
		} else if !errors.Is(err, bus.ErrPermissionViolation) {
			return err
		}
		return nil
	})
}

// TestTokenReadAgainAtReconnect: the user ends with its bound (MaxTTL 1s here), the server closes the
// connection, and the client connects again with the token now in the file; a bad token there is refused
// and the client keeps trying until a good one is back.
func TestTokenReadAgainAtReconnect(t *testing.T) {
	l := startLab(t, time.Second)
	exp := time.Now().Add(10 * time.Minute)
	first := token(t, podClaims("j1", "uid-1", exp))
	second := token(t, podClaims("j2", "uid-1", exp)) // the kubelet's next token for the same pod
	for _, tok := range []string{first, second} {
		l.api.set(tok, accepted(agentSA, "node-1", "agent-1"))
	}
	l.startCallout()
	file := l.write("token", first)
	b, err := l.connect(file)
	if err != nil {
		t.Fatal(err)
	}
	l.write("token", "not-a-token")
	bustest.WaitFor(t, "the refused token tried", func() bool { return l.api.wasReviewed("not-a-token") })
	l.write("token", second)
	bustest.WaitFor(t, "the second token reviewed", func() bool { return l.api.wasReviewed(second) })
	bustest.WaitFor(t, "connected again", func() bool { return b.Connected() })
	own := events.EventSubject("node-1", "image", "added")
	if err := b.PublishRaw(own, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	fctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := b.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	if b.PermissionViolation(own) != nil {
		t.Errorf("publishing its own event after the reconnect: %v", b.PermissionViolation(own))
	}
	if strings.Contains(l.logs.String(), second) {
		t.Error("the token is in the log")
	}
}

// TestCalloutDownThenUp: with two replicas one suffices; with none a connect is refused with an error
// that names the callout; one started again lets clients in.
func TestCalloutDownThenUp(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	l := startLab(t, time.Hour)
	tok := token(t, podClaims("j1", "uid-1", time.Now().Add(10*time.Minute)))
	l.api.set(tok, accepted(agentSA, "node-1", "agent-1"))
	file := l.write("token", tok)
	stopA, stopB := l.startCallout(), l.startCallout()
	if _, err := l.connect(file); err != nil {
		t.Fatalf("two replicas: %v", err)
	}
	stopA()
	if _, err := l.connect(file); err != nil {
		t.Fatalf("one replica left: %v", err)
	}
	stopB()
	_, err := l.connect(file)
	if err == nil || bus.IsUnreachable(err) || !strings.Contains(err.Error(), "auth callout") {
		t.Fatalf("no callout: %v, want a refusal naming the callout", err)
	}
	l.startCallout()
	if _, err := l.connect(file); err != nil {
		t.Fatalf("callout back: %v", err)
	}
}

// TestAPIServerDownThenBack: the callout refuses while the API server cannot be asked, says so, and lets the
// same token in once it can.
func TestAPIServerDownThenBack(t *testing.T) {
	l := startLab(t, time.Hour)
	tok := token(t, podClaims("j1", "uid-1", time.Now().Add(10*time.Minute)))
	l.api.set(tok, accepted(agentSA, "node-1", "agent-1"))
	file := l.write("token", tok)
	l.startCallout()
	l.api.setDown(true)
	if _, err := l.connect(file); err == nil || bus.IsUnreachable(err) {
		t.Fatalf("API server down: %v, want a refusal", err)
	}
	if !strings.Contains(l.logs.String(), `reason="token review failed: Post`) {
		t.Errorf("the log does not say the review failed:\n%s", l.logs.String())
	}
	l.api.setDown(false)
	if _, err := l.connect(file); err != nil {
		t.Fatalf("API server back: %v", err)
	}
}
