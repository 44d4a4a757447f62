package lab

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		name, method, path string
		repo, kind         string
		ok                 bool
	}{
		{"manifest get", "GET", "/v2/lab/pause/manifests/1", "lab/pause", "manifests", true},
		{"manifest head", "HEAD", "/v2/a/b/c/manifests/sha256:abc", "a/b/c", "manifests", true},
		{"blob get", "GET", "/v2/lab/x/blobs/sha256:abc", "lab/x", "blobs", true},
		{"repo named blobs", "GET", "/v2/blobs/blobs/sha256:abc", "blobs", "blobs", true},
		{"upload start", "POST", "/v2/lab/x/blobs/uploads/", "", "", false},
		{"upload status", "GET", "/v2/lab/x/blobs/uploads/123", "", "", false},
		{"manifest put", "PUT", "/v2/lab/x/manifests/1", "", "", false},
		{"version check", "GET", "/v2/", "", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			repo, kind, ok := classify(httptest.NewRequest(tt.method, tt.path, nil))
			if repo != tt.repo || kind != tt.kind || ok != tt.ok {
				t.Errorf("classify(%s %s) = %q, %q, %v; want %q, %q, %v", tt.method, tt.path, repo, kind, ok, tt.repo, tt.kind, tt.ok)
			}
		})
	}
}

func TestSplitRepoTag(t *testing.T) {
	tests := []struct{ in, repo, tag string }{
		{"lab/pause:1", "lab/pause", "1"},
		{"lab/pause", "lab/pause", "latest"},
		{"a/b/c:v1.2", "a/b/c", "v1.2"},
	}
	for _, tt := range tests {
		if repo, tag := splitRepoTag(tt.in); repo != tt.repo || tag != tt.tag {
			t.Errorf("splitRepoTag(%q) = %q, %q; want %q, %q", tt.in, repo, tag, tt.repo, tt.tag)
		}
	}
}

// TestPushRoundTrip pushes to the in-process registry and reads the image back as a runtime would: the
// manifest by tag, the config by digest; the sizes and IDs Push reports must match what was stored.
func TestPushRoundTrip(t *testing.T) {
	reg := StartRegistry(t, RegistryOptions{})
	p, err := Push(t.Context(), reg.Host(), "lab/rt:1", 3<<20, WithLayers(3), WithLabel("team", "gc"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := Push(t.Context(), reg.Host(), "lab/rt:1", 3<<20, WithLayers(3), WithLabel("team", "gc"))
	if err != nil {
		t.Fatal(err)
	}
	if again != p {
		t.Errorf("pushing the same image twice: %+v then %+v, want the same", p, again)
	}
	other, err := Push(t.Context(), reg.Host(), "lab/rt:2", 3<<20, WithLayers(3), WithLabel("team", "gc"))
	if err != nil {
		t.Fatal(err)
	}
	if other.ID == p.ID {
		t.Errorf("two tags share the image ID %s, want distinct IDs", p.ID)
	}

	get := func(path string) []byte {
		t.Helper()
		resp, err := http.Get("http://" + reg.Host() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		if _, err := b.ReadFrom(resp.Body); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s %v", path, resp.Status, err)
		}
		return b.Bytes()
	}
	raw := get("/v2/lab/rt/manifests/1")
	if d := digestOf(raw); d != p.Digest {
		t.Errorf("manifest digest %s, want %s", d, p.Digest)
	}
	var m struct {
		Config descriptor   `json:"config"`
		Layers []descriptor `json:"layers"`
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if m.Config.Digest != p.ID || len(m.Layers) != 3 {
		t.Fatalf("manifest %s: config %s and %d layers, want %s and 3", raw, m.Config.Digest, len(m.Layers), p.ID)
	}
	size := int64(len(raw)) + m.Config.Size
	for _, l := range m.Layers {
		size += l.Size
	}
	if size != p.Size {
		t.Errorf("stored size %d, Push reported %d", size, p.Size)
	}
	if d := p.Size - 3<<20; d < -4096 || d > 4096 {
		t.Errorf("size %d, want about %d", p.Size, 3<<20)
	}
	var cfg struct {
		Config struct{ Labels map[string]string }
	}
	if err := json.Unmarshal(get("/v2/lab/rt/blobs/"+p.ID), &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Config.Labels["team"] != "gc" || cfg.Config.Labels["imagefleet.lab/ref"] != p.Ref {
		t.Errorf("config labels %v, want team=gc and the reference", cfg.Config.Labels)
	}
	if st := reg.Stats(); st.ManifestReads != 1 || st.BlobReads != 1 || st.InFlight != 0 {
		t.Errorf("stats %+v, want one manifest and one blob read, none in flight", st)
	}
}

// TestRegistryMaxInFlight holds reads with a delay so that three at once are seen together.
func TestRegistryMaxInFlight(t *testing.T) {
	reg := StartRegistry(t, RegistryOptions{Delay: 200 * time.Millisecond})
	var wg sync.WaitGroup
	for _, repo := range []string{"a", "b", "c"} {
		wg.Go(func() {
			resp, err := http.Get("http://" + reg.Host() + "/v2/" + repo + "/manifests/1")
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
		})
	}
	wg.Wait()
	if st := reg.Stats(); st.MaxInFlight != 3 || st.MaxReposInFlight != 3 || st.InFlight != 0 {
		t.Errorf("stats %+v, want 3 reads of 3 repositories at once, none now", st)
	}
	reg.ResetStats()
	if st := reg.Stats(); st != (RegistryStats{}) {
		t.Errorf("after ResetStats: %+v, want zeros", st)
	}
}

func TestRegistryAuth(t *testing.T) {
	reg := StartRegistry(t, RegistryOptions{User: "u", Password: "p"})
	if _, err := Push(t.Context(), reg.Host(), "lab/a:1", 1024); err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("push without credentials: %v, want 401", err)
	}
	if _, err := Push(t.Context(), reg.Host(), "lab/a:1", 1024, WithAuth("u", "wrong")); err == nil {
		t.Error("push with a wrong password succeeded")
	}
	if _, err := Push(t.Context(), reg.Host(), "lab/a:1", 1024, WithAuth("u", "p")); err != nil {
		t.Errorf("push with credentials: %v", err)
	}
	if st := reg.Stats(); st.Unauthorized != 2 {
		t.Errorf("stats %+v, want 2 unauthorized", st)
	}
}

func TestConfigRendersRequiredSettings(t *testing.T) {
	for _, sandbox := range []string{"127.0.0.1:5000/lab/pause:1", ""} {
		c := &Containerd{dir: t.TempDir(), snap: "overlayfs", opts: Options{SandboxImage: sandbox}}
		c.opts.defaults()
		c.configPath = filepath.Join(c.dir, "config.toml")
		if err := c.writeConfig(); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(c.configPath)
		if err != nil {
			t.Fatal(err)
		}
		got := string(b)
		for _, want := range []string{"restrict_oom_score_adj = true", "[debug]\n  address = \"\"", `Root = "` + c.dir + `/runc"`, `snapshotter = "overlayfs"`, "stats_collect_period = 1\n"} {
			if !strings.Contains(got, want) {
				t.Errorf("config lacks %q:\n%s", want, got)
			}
		}
		if has := strings.Contains(got, "sandbox_image"); has != (sandbox != "") {
			t.Errorf("sandbox image %q: config has sandbox_image %v:\n%s", sandbox, has, got)
		}
	}
	// The operator's template must hold the same required settings.
	tmpl, err := os.ReadFile("../../deploy/lab/containerd.toml.tmpl")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"restrict_oom_score_adj = true", "[debug]\n  address = \"\"", `Root = "@LAB_DIR@/runc"`, `sandbox_image = "@SANDBOX_IMAGE@"`} {
		if !strings.Contains(string(tmpl), want) {
			t.Errorf("deploy/lab/containerd.toml.tmpl lacks %q", want)
		}
	}
}
