package main

import (
	"archive/tar"
	"bytes"
	"debug/buildinfo"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

func TestFlags(t *testing.T) {
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"no output":         {nil, "usage: nothing to write: give --image, --oci-layout or --tarball"},
		"arguments":         {[]string{"--oci-layout", "x", "agent"}, `usage: unexpected arguments ["agent"]`},
		"platform":          {[]string{"--oci-layout", "x", "--platforms", "linux"}, `usage: --platforms: "linux" is not os/arch[/variant]`},
		"platform twice":    {[]string{"--oci-layout", "x", "--platforms", "linux/amd64,linux/amd64"}, "usage: --platforms: linux/amd64 given twice"},
		"not a git tree":    {[]string{"--oci-layout", "x", "--repo", "/"}, "--repo /: git rev-parse --show-toplevel: "},
		"unknown flag":      {[]string{"--push"}, "flag provided but not defined: -push"},
		"SOURCE_DATE_EPOCH": {[]string{"--oci-layout", "x", "--revision", "HEAD"}, `SOURCE_DATE_EPOCH="yesterday": want seconds since the Unix epoch`},
	} {
		t.Run(name, func(t *testing.T) {
			if name == "SOURCE_DATE_EPOCH" {
				t.Setenv("SOURCE_DATE_EPOCH", "yesterday")
			}
			var stdout, stderr bytes.Buffer
			err := run(t.Context(), tc.args, &stdout, &stderr)
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			if stdout.Len() > 0 {
				t.Errorf("stdout %q after a failure", stdout.String())
			}
		})
	}
}

// TestRefusesChangedTree: without --revision, uncommitted or untracked files stop the build before
// anything is compiled, naming them.
func TestRefusesChangedTree(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{{"init", "--quiet"}, {"commit", "--quiet", "--allow-empty", "-m", "x"}} {
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"}, args...)...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "wip.go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err := run(t.Context(), []string{"--repo", dir, "--oci-layout", filepath.Join(t.TempDir(), "l")}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "has changes the image would not contain (wip.go)") ||
		!strings.Contains(err.Error(), "--revision HEAD") {
		t.Fatalf("error %v, want a refusal naming wip.go and --revision HEAD", err)
	}
}

// TestRealImage builds the real imagefleet, from this repository's HEAD, for this machine's platform,
// into a layout, and checks the binary in the image: it runs, and it reports the version and the
// commit the image's annotations name. A cold build takes a minute or more; `task image` and
// docs/image.md check both platforms and the digest across two builds.
func TestRealImage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds imagefleet from this repository's HEAD (a minute or more)")
	}
	dir := filepath.Join(t.TempDir(), "layout")
	var stdout, stderr bytes.Buffer
	p := v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
	if err := run(t.Context(), []string{"--revision", "HEAD", "--platforms", p.String(), "--oci-layout", dir}, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	head, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatal(err)
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	digest := tm.Manifests[0].Digest
	if strings.TrimSpace(stdout.String()) != digest.String() {
		t.Errorf("printed %q, the layout holds %s", stdout.String(), digest)
	}
	idx, err := top.ImageIndex(digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Platform.String() != p.String() {
		t.Fatalf("index lists %v, want %s only", im.Manifests, p.String())
	}
	if im.Annotations["org.opencontainers.image.revision"] != strings.TrimSpace(string(head)) {
		t.Errorf("revision annotation %q, HEAD is %s", im.Annotations["org.opencontainers.image.revision"], head)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "imagefleet")
	extract(t, layers[len(layers)-1], "usr/local/bin/imagefleet", bin)
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if v := im.Annotations["org.opencontainers.image.version"]; bi.Main.Version != v || v == "" {
		t.Errorf("the binary reports %q, the image says %q", bi.Main.Version, v)
	}
	if out, err := exec.Command(bin, "--help").CombinedOutput(); err != nil {
		t.Errorf("the image's binary does not run here: %v\n%s", err, out)
	}
}

// extract copies the file name out of layer l into path.
func extract(t *testing.T, l v1.Layer, name, path string) {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			t.Fatalf("%s not in the layer", name)
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name != name {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, b, 0o755); err != nil {
			t.Fatal(err)
		}
		return
	}
}
