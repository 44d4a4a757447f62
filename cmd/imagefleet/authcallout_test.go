package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAuthCalloutFlags: every flag error of `bus auth-callout`, `bus keys` and the global token and password
// files is reported before any connection is made, with the flag's name.
func TestAuthCalloutFlags(t *testing.T) {
	dir := t.TempDir()
	// A user seed (not an account seed), from gen-creds.
	if _, stderr, code := run(t, "bus", "gen-creds", "--nodes", "node-1", "--out", dir); code != 0 {
		t.Fatalf("gen-creds: %s", stderr)
	}
	userSeed := filepath.Join(dir, "nodes", "node-1.nk")
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	kubeconfig := write("kubeconfig", `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: c, context: {cluster: c, user: u, namespace: from-kubeconfig}}]
current-context: c
`)
	const unreachable = "nats://127.0.0.1:1"
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no identity let in", []string{"bus", "auth-callout", "--issuer-seed-file", userSeed},
			"give --node-service-account or --role (or both): without them every token is refused"},
		{"unknown role", []string{"bus", "auth-callout", "--role", "root=ns/sa"}, `--role: role "root=ns/sa": unknown role "root"`},
		{"role without service account", []string{"bus", "auth-callout", "--role", "admin"}, `--role: role "admin": want ROLE=NAMESPACE/NAME`},
		{"node service account without namespace", []string{"bus", "auth-callout", "--node-service-account", "agent"},
			`--node-service-account: service account "agent": want NAMESPACE/NAME`},
		{"no seed", []string{"bus", "auth-callout", "--node-service-account", "ns/agent"}, "--issuer-seed-file is required"},
		{"missing seed", []string{"bus", "auth-callout", "--node-service-account", "ns/agent", "--issuer-seed-file", filepath.Join(dir, "none")},
			"--issuer-seed-file: open "},
		{"user seed", []string{"bus", "auth-callout", "--node-service-account", "ns/agent", "--issuer-seed-file", userSeed},
			"issuer seed: not an account seed (SA...)"},
		{"empty audience", []string{"bus", "auth-callout", "--node-service-account", "ns/agent", "--audience", ""}, "--audience must not be empty"},
		{"keys without secret", []string{"bus", "keys"}, "--secret is required"},
		{"keys namespace from the kubeconfig", []string{"bus", "keys", "--secret", "k", "--kubeconfig", kubeconfig, "--timeout", "5s"},
			"namespace from-kubeconfig: get secret k: "},
		{"missing token file", []string{"--nats", unreachable, "--token-file", filepath.Join(dir, "none"), "fleet", "nodes"}, "read nats token file: open "},
		{"empty token file", []string{"--nats", unreachable, "--token-file", write("empty", "\n"), "fleet", "nodes"}, "read nats token file " + dir + "/empty: empty"},
		{"token and nkey", []string{"--nats", unreachable, "--token-file", write("tok", "a.b.c"), "--nkey", userSeed, "fleet", "nodes"},
			"a token file and an nkey or credentials file are two identities: give one"},
		{"password file without user", []string{"--nats", unreachable, "--password-file", write("pw", "p1"), "fleet", "nodes"},
			"a password file needs a user and no password"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, stderr, code := run(t, tc.args...)
			if code == 0 || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, stderr %q; want an error containing %q", code, stderr, tc.want)
			}
			for _, secret := range []string{"a.b.c", "p1"} {
				if strings.Contains(stderr, secret) {
					t.Errorf("stderr quotes the secret %q", secret)
				}
			}
		})
	}
}
