package puller

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/events"
)

func dockerConfig(entries map[string][2]string) string {
	var parts []string
	for reg, up := range entries {
		auth := base64.StdEncoding.EncodeToString([]byte(up[0] + ":" + up[1]))
		parts = append(parts, fmt.Sprintf("%q: {\"auth\": %q}", reg, auth))
	}
	return `{"auths": {` + strings.Join(parts, ",") + `}}`
}

func TestKeyringLookup(t *testing.T) {
	k := &keyring{}
	cfg, err := parseDockerConfig([]byte(dockerConfig(map[string][2]string{
		"quay.io":                      {"quay-host", "p1"},
		"quay.io/coreos":               {"quay-coreos", "p2"},
		"*.example.com":                {"glob", "p3"},
		"https://index.docker.io/v1/":  {"hub", "p4"},
		"localhost:5000":               {"local", "p5"},
		"http://registry.local/v2/ns/": {"ns", "p6"},
	})))
	if err != nil {
		t.Fatal(err)
	}
	if err := k.add(cfg, nil); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		repo string
		want []string
	}{
		{"quay.io/coreos/etcd", []string{"quay-coreos", "quay-host"}},
		{"quay.io/other/etcd", []string{"quay-host"}},
		{"a.example.com/x", []string{"glob"}},
		{"a.b.example.com/x", nil},
		{"docker.io/library/busybox", []string{"hub"}},
		{"localhost:5000/busybox", []string{"local"}},
		{"localhost:5001/busybox", nil},
		{"registry.local/ns/app", []string{"ns"}},
		{"registry.local/other/app", nil},
	} {
		t.Run(c.repo, func(t *testing.T) {
			var got []string
			for _, cr := range k.lookup(c.repo) {
				got = append(got, cr.Auth.Username)
			}
			if strings.Join(got, ",") != strings.Join(c.want, ",") {
				t.Errorf("lookup(%q) = %v, want %v", c.repo, got, c.want)
			}
		})
	}
}

func TestDecodeAuthField(t *testing.T) {
	for _, c := range []struct {
		field, user, pass string
		bad               bool
	}{
		{base64.StdEncoding.EncodeToString([]byte("u:p:x")), "u", "p:x", false},
		{base64.RawStdEncoding.EncodeToString([]byte("ab:c")), "ab", "c", false},
		{base64.StdEncoding.EncodeToString([]byte("nocolon")), "", "", true},
		{"%%%", "", "", true},
	} {
		u, p, err := decodeAuthField(c.field)
		if (err != nil) != c.bad || u != c.user || p != c.pass {
			t.Errorf("decodeAuthField(%q) = %q %q %v", c.field, u, p, err)
		}
	}
}

const secretYAML = `apiVersion: v1
kind: Secret
metadata:
  name: regcred
  namespace: team-a
  uid: 6f1c0d7e-uid
type: kubernetes.io/dockerconfigjson
data:
  .dockerconfigjson: %s
`

// TestSecretCredentialsNeverLogged: pull secrets from the directory are matched to the image's registry,
// tried before the node's, sent to the runtime, and their passwords appear in no log line, event message
// or result.
func TestSecretCredentialsNeverLogged(t *testing.T) {
	dir := t.TempDir()
	const podPass, nodePass = "s3cr3t-pod-password", "n0de-password"
	sec := fmt.Sprintf(secretYAML, base64.StdEncoding.EncodeToString([]byte(dockerConfig(map[string][2]string{"registry.local:5000": {"alice", podPass}}))))
	if err := os.WriteFile(filepath.Join(dir, "regcred.yaml"), []byte(sec), 0o600); err != nil {
		t.Fatal(err)
	}
	nodeCfg := filepath.Join(t.TempDir(), "config.json")
	if err := os.WriteFile(nodeCfg, []byte(dockerConfig(map[string][2]string{"registry.local:5000": {"node", nodePass}})), 0o600); err != nil {
		t.Fatal(err)
	}
	node, err := loadNodeKeyring(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h := newHarness(harnessOpts{serial: true})
	h.m.cfg.log = log
	h.m.creds = &fileCredentials{secrets: &secretsDir{dir: dir}, node: node, log: log}
	h.rt.err = fmt.Errorf("unauthorized: authentication required")
	pod := events.PodRef{Namespace: "team-a", Name: "web", UID: "uid-1"}
	out := h.m.EnsureImageExists(t.Context(), Request{Image: "registry.local:5000/app:1", Policy: events.PullIfNotPresent, Pod: pod,
		Secrets: []string{"regcred", "missing"}})
	if !errorsIsPull(out) {
		t.Fatalf("outcome %+v", out)
	}
	if len(h.rt.auths) != 2 || h.rt.auths[0].Username != "alice" || h.rt.auths[0].Password != podPass || h.rt.auths[1].Username != "node" {
		t.Fatalf("credentials tried: %v", h.rt.auths)
	}
	if !strings.Contains(logs.String(), "unable to retrieve pull secret") {
		t.Errorf("missing secret not logged: %s", logs.String())
	}
	all := logs.String() + out.Message + fmt.Sprintf("%v %+v %#v", out.Events, h.rt.auths, *h.rt.auths[0])
	for _, secret := range []string{podPass, nodePass, base64.StdEncoding.EncodeToString([]byte("alice:" + podPass))} {
		if strings.Contains(all, secret) {
			t.Fatalf("a credential leaked into logs, events or messages: %s", all)
		}
	}
}

func errorsIsPull(o Outcome) bool { return o.Kind() == events.ErrKindImagePull && len(o.Events) == 2 }

// TestPullRecordsWithSecrets (#18787, KEP-2535): an image pulled with pod A's secret is not given to pod B,
// which has no credentials: B pulls again (IfNotPresent) or is refused (Never); A is served from the node.
func TestPullRecordsWithSecrets(t *testing.T) {
	h := newHarness(harnessOpts{serial: true, images: []string{}})
	credsA := staticCreds{secretCred("team-a", "regcred", "uid-sec", "hash-a")}
	h.m.creds = credsA
	podA := events.PodRef{Namespace: "team-a", Name: "a", UID: "pod-a"}
	if o := h.m.EnsureImageExists(t.Context(), Request{Image: "private/app:1", Policy: events.PullIfNotPresent, Pod: podA}); o.Err != nil || !o.Pulled {
		t.Fatalf("pod a pull: %+v", o)
	}
	if o := h.m.EnsureImageExists(t.Context(), Request{Image: "private/app:1", Policy: events.PullIfNotPresent, Pod: podA}); o.Pulled || o.Err != nil {
		t.Fatalf("pod a again: pulled %v err %v, want served from the node", o.Pulled, o.Err)
	}
	h.m.creds = staticCreds(nil)
	podB := events.PodRef{Namespace: "team-b", Name: "b", UID: "pod-b"}
	if o := h.m.EnsureImageExists(t.Context(), Request{Image: "private/app:1", Policy: events.PullNever, Pod: podB}); o.Kind() != events.ErrKindImageNeverPull ||
		o.Message != `Container image "private/app:1" is not present with pull policy of Never` {
		t.Fatalf("pod b Never: %s %q", o.Kind(), o.Message)
	}
	h.rt.resetCalls()
	if o := h.m.EnsureImageExists(t.Context(), Request{Image: "private/app:1", Policy: events.PullIfNotPresent, Pod: podB}); !o.Pulled {
		t.Fatalf("pod b IfNotPresent: %+v, want a pull with its own (no) credentials", o)
	}
	// The anonymous pull succeeded: the image is now accessible to every pod.
	podC := events.PodRef{Namespace: "team-c", Name: "c", UID: "pod-c"}
	if o := h.m.EnsureImageExists(t.Context(), Request{Image: "private/app:1", Policy: events.PullNever, Pod: podC}); o.Err != nil {
		t.Fatalf("pod c after an anonymous pull: %v", o.Err)
	}
}

// TestSecretKeyringNeedsTypeAndKey: a pull secret is used only with the docker-config type and that type's
// key (the kubelet's secretsToTrackedDockerConfigs); a key without the type, or the type with the other
// type's key or an empty key, is skipped.
func TestSecretKeyringNeedsTypeAndKey(t *testing.T) {
	cfgJSON := []byte(dockerConfig(map[string][2]string{"registry.example": {"user", "pass"}}))
	legacy := []byte(`{"registry.example": {"auth": "` + base64.StdEncoding.EncodeToString([]byte("user:pass")) + `"}}`)
	for _, c := range []struct {
		name string
		typ  corev1.SecretType
		data map[string][]byte
		used bool
	}{
		{"dockerconfigjson", corev1.SecretTypeDockerConfigJson, map[string][]byte{corev1.DockerConfigJsonKey: cfgJSON}, true},
		{"dockercfg", corev1.SecretTypeDockercfg, map[string][]byte{corev1.DockerConfigKey: legacy}, true},
		{"opaque with .dockerconfigjson", corev1.SecretTypeOpaque, map[string][]byte{corev1.DockerConfigJsonKey: cfgJSON}, false},
		{"no type with .dockercfg", "", map[string][]byte{corev1.DockerConfigKey: legacy}, false},
		{"dockerconfigjson type with .dockercfg key", corev1.SecretTypeDockerConfigJson, map[string][]byte{corev1.DockerConfigKey: legacy}, false},
		{"dockercfg type with .dockerconfigjson key", corev1.SecretTypeDockercfg, map[string][]byte{corev1.DockerConfigJsonKey: cfgJSON}, false},
		{"dockerconfigjson type with an empty key", corev1.SecretTypeDockerConfigJson, map[string][]byte{corev1.DockerConfigJsonKey: {}}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := corev1.Secret{Type: c.typ, Data: c.data}
			s.Namespace, s.Name = "ns", "pull"
			k, err := secretKeyring([]corev1.Secret{s})
			if err != nil {
				t.Fatal(err)
			}
			if got := len(k.lookup("registry.example/app")) > 0; got != c.used {
				t.Errorf("secret used = %v, want %v", got, c.used)
			}
		})
	}
}

// TestPrePullOfPrivateImagesNeedsOptIn: a pull without a pod that would use the node keyring's credentials is
// refused (ErrImagePull, no runtime pull) unless the request allows it: pulled through CRI, the image would
// have no kubelet pull record, and under the kubelet's default NeverVerifyPreloadedImages every pod on the
// node could use it. An image of a registry the keyring does not know is pre-pulled as before.
func TestPrePullOfPrivateImagesNeedsOptIn(t *testing.T) {
	nodeCfg := filepath.Join(t.TempDir(), "config.json")
	if err := os.WriteFile(nodeCfg, []byte(dockerConfig(map[string][2]string{"registry.local:5000": {"node", "n0de-password"}})), 0o600); err != nil {
		t.Fatal(err)
	}
	node, err := loadNodeKeyring(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(harnessOpts{serial: true})
	h.m.creds = &fileCredentials{node: node, log: h.m.cfg.log}

	out := h.m.EnsureImageExists(t.Context(), Request{Image: "registry.local:5000/private:1", Policy: events.PullIfNotPresent})
	if out.Kind() != events.ErrKindImagePull || !strings.Contains(out.Message, "--allow-private") || len(h.rt.auths) != 0 {
		t.Fatalf("pre-pull of a private image: %+v, credentials tried %v: want a refusal before any pull", out, h.rt.auths)
	}
	if calls := h.rt.resetCalls(); slices.Contains(calls, "PullImage") {
		t.Fatalf("runtime calls %v: want no pull", calls)
	}
	out = h.m.EnsureImageExists(t.Context(), Request{Image: "registry.local:5000/private:1", Policy: events.PullIfNotPresent, AllowPrivate: true})
	if out.Err != nil || len(h.rt.auths) != 1 || h.rt.auths[0].Username != "node" {
		t.Fatalf("pre-pull with allowPrivate: %+v, credentials %v: want pulled with the node's", out, h.rt.auths)
	}
	out = h.m.EnsureImageExists(t.Context(), Request{Image: "public.example/app:1", Policy: events.PullIfNotPresent})
	if out.Err != nil {
		t.Fatalf("pre-pull of a public image: %+v", out)
	}
	// A pod's pull with the node's credentials is the kubelet's case: a pull record is written for it.
	out = h.m.EnsureImageExists(t.Context(), Request{Image: "registry.local:5000/private:2", Policy: events.PullIfNotPresent,
		Pod: events.PodRef{Namespace: "ns", Name: "p", UID: "uid-p"}})
	if out.Err != nil {
		t.Fatalf("a pod's pull with the node keyring: %+v", out)
	}
}
