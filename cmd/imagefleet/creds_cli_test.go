package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestGenCredsSites: gen-creds writes the hub's config (its sites' leaf-only identities, the leaf listener
// with TLS) and a site's (its domain, its nodes, the leaf connection to the hub with the site's seed and the
// client certificate); a site's config without its connection to the hub is refused with a clear error.
// TestLeafSecurityNodeIsolation (integration/) starts servers from these configs.
func TestGenCredsSites(t *testing.T) {
	dir := t.TempDir()
	tls, hub, site := filepath.Join(dir, "tls"), filepath.Join(dir, "hub"), filepath.Join(dir, "edge-1")
	if out, errOut, code := run(t, "bus", "gen-creds", "--out", hub, "--tls-dir", tls, "--gen-test-certs",
		"--domain", "hub", "--sites", "edge-1,edge-2", "--leaf-listen", "127.0.0.1:7422"); code != 0 {
		t.Fatalf("hub: exit %d\n%s%s", code, out, errOut)
	}
	conf, err := os.ReadFile(filepath.Join(hub, "nats.conf"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`domain: "hub"`, `listen: "127.0.0.1:7422"`, `allowed_connection_types: ["LEAFNODE"]`, "# site edge-2"} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("hub config lacks %q", want)
		}
	}
	seed := filepath.Join(hub, "sites", "edge-1.nk")
	if out, errOut, code := run(t, "bus", "gen-creds", "--out", site, "--tls-dir", tls, "--nodes", "n1,n2",
		"--domain", "edge-1", "--js-domain", "hub", "--hub-url", "nats-leaf://127.0.0.1:7422", "--site-seed", seed); code != 0 {
		t.Fatalf("site: exit %d\n%s%s", code, out, errOut)
	}
	conf, err = os.ReadFile(filepath.Join(site, "nats.conf"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`domain: "edge-1"`, `urls: [ "nats-leaf://127.0.0.1:7422" ]`, `account: "IMAGEFLEET"`,
		`cert_file: "` + filepath.Join(tls, "client.pem") + `"`, `"$JS.hub.API.$KV.imagefleet-nodes.n2"`} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("site config lacks %q", want)
		}
	}
	for _, f := range []string{"nodes/n1.nk", "nodes/n2.nk", "admin.nk"} {
		if _, err := os.Stat(filepath.Join(site, f)); err != nil {
			t.Errorf("site: %v", err)
		}
	}
	if _, err := os.Stat(filepath.Join(site, "fleet.nk")); err == nil {
		t.Error("a site's config has a fleet identity; the fleet works at the hub")
	}
	_, errOut, code := run(t, "bus", "gen-creds", "--out", filepath.Join(dir, "bad"), "--nodes", "n1", "--domain", "edge-1", "--js-domain", "hub")
	if code == 0 || !strings.Contains(errOut, "needs its leaf connection to the hub") {
		t.Errorf("a site without --hub-url: exit %d, stderr %q", code, errOut)
	}
}
