package natsconf_test

import (
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nkeys"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// goldenCallout is the three-replica StatefulSet's config the chart renders: read testdata/callout.conf
// for the block to use.
var goldenCallout = natsconf.CalloutOptions{
	ServerNameEnv: "POD_NAME",
	StoreDir:      "/data/jetstream",
	TLS:           &natsconf.TLSFiles{Cert: "/etc/nats/tls/tls.crt", Key: "/etc/nats/tls/tls.key"},
	Cluster: &natsconf.CalloutCluster{Routes: []string{
		"nats-route://imagefleet-nats-0.imagefleet-nats:6222",
		"nats-route://imagefleet-nats-1.imagefleet-nats:6222",
		"nats-route://imagefleet-nats-2.imagefleet-nats:6222",
	}},
}

func TestRenderCalloutGolden(t *testing.T) {
	got, err := natsconf.RenderCallout(goldenCallout)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join("testdata", "callout.conf")
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("RenderCallout differs from %s (go test -update to accept):\n%s", path, got)
	}
}

func TestRenderCalloutRefusesBadOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    natsconf.CalloutOptions
		want string
	}{
		{"variable name", natsconf.CalloutOptions{IssuerEnv: "issuer-pub"}, `"issuer-pub" is not an environment variable name`},
		{"name twice", natsconf.CalloutOptions{ServerName: "a", ServerNameEnv: "POD_NAME"}, "not both"},
		{"cluster without names", natsconf.CalloutOptions{Cluster: &natsconf.CalloutCluster{}}, "need distinct names"},
		{"verify without TLS", natsconf.CalloutOptions{VerifyClients: true}, "needs TLS"},
		{"verify without CA", natsconf.CalloutOptions{VerifyClients: true, TLS: &natsconf.TLSFiles{Cert: "c", Key: "k"}}, "needs a CA"},
		{"route TLS without CA", natsconf.CalloutOptions{ServerName: "a", Cluster: &natsconf.CalloutCluster{TLS: &natsconf.TLSFiles{Cert: "c", Key: "k"}}}, "route TLS needs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := natsconf.RenderCallout(tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestCalloutConfigServes starts a real server from the rendered config with the issuer and the password in
// the environment, as the chart's pods do: the callout's user gets in with the password and not without it,
// and with no callout answering a token is refused, with an error that says where to look.
func TestCalloutConfigServes(t *testing.T) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	const password = "p0123456789abcdef"
	t.Setenv(natsconf.DefaultIssuerEnv, pub)
	t.Setenv(natsconf.DefaultPasswordEnv, password)
	dir := t.TempDir()
	// A host outside Kubernetes keeps its nkey: its user is checked by the server, never by the callout.
	hosts, err := natsconf.Generate(filepath.Join(dir, "hosts"), natsconf.Options{Nodes: []string{"host-1"}})
	if err != nil {
		t.Fatal(err)
	}
	conf, err := natsconf.RenderCallout(natsconf.CalloutOptions{Hosts: hosts.Identities[:1]})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(file, conf, 0o600); err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: file, Listen: "127.0.0.1:-1", StoreDir: filepath.Join(dir, "js")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	connect := func(o bus.Options) error {
		o.ConnectTimeout = 3 * time.Second
		b, err := bus.Connect(t.Context(), srv.ClientURL(), o)
		if err == nil {
			b.Close()
		}
		return err
	}
	if err := connect(bus.Options{User: natsconf.CalloutUser, PasswordFile: write("pw", password)}); err != nil {
		t.Errorf("the callout's user with its password: %v", err)
	}
	if err := connect(bus.Options{NKeyFile: hosts.Identities[0].SeedFile}); err != nil {
		t.Errorf("a host's nkey with no callout running: %v", err)
	}
	err = connect(bus.Options{User: natsconf.CalloutUser, PasswordFile: write("bad", "pwrong")})
	if err == nil || bus.IsUnreachable(err) || !strings.Contains(err.Error(), "refused user callout") {
		t.Errorf("the callout's user with a wrong password: %v, want a refusal naming the user", err)
	}
	err = connect(bus.Options{TokenFile: write("tok", "a.b.c")})
	if err == nil || bus.IsUnreachable(err) || !strings.Contains(err.Error(), "auth callout") {
		t.Errorf("a token with no callout running: %v, want a refusal pointing at the callout", err)
	}
	if err == nil || strings.Contains(err.Error(), "a.b.c") {
		t.Errorf("the error quotes the token: %v", err)
	}
	for _, role := range natsconf.CalloutRoles {
		if _, err := natsconf.RolePermissions(role, "X"); err != nil {
			t.Errorf("role %s: %v", role, err)
		}
	}
	if _, err := natsconf.RolePermissions(natsconf.RoleNode, "X"); err == nil {
		t.Error("RolePermissions gives the node role without a node")
	}
	c := natsconf.CentralPermissions("X")
	for _, p := range append(natsconf.FleetPermissions("X").Publish, natsconf.InventoryPermissions("X").Publish...) {
		if !slices.Contains(c.Publish, p) {
			t.Errorf("central lacks publish %s", p)
		}
	}
}
