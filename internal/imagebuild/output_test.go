package imagebuild_test

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/imagefleet/imagefleet/internal/imagebuild"
)

// TestPushReadBack pushes the index to an in-process registry over plain HTTP (as to the lab's
// registry on 127.0.0.1), then reads it back by digest: the same index, both platforms, and each
// image's config and layers as built.
func TestPushReadBack(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")

	idx, err := imagebuild.Index(spec(t, 1, amd64, arm64))
	if err != nil {
		t.Fatal(err)
	}
	want, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := imagebuild.Push(t.Context(), host+"/imagefleet:test", idx, false)
	if err != nil {
		t.Fatal(err)
	}
	if pinned.String() != host+"/imagefleet@"+want.String() {
		t.Fatalf("Push returned %s, want %s/imagefleet@%s", pinned, host, want)
	}

	got, err := remote.Index(pinned, remote.WithContext(t.Context()))
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := got.Digest(); d != want {
		t.Fatalf("read back index %s, pushed %s", d, want)
	}
	tag, err := name.NewTag(host + "/imagefleet:test")
	if err != nil {
		t.Fatal(err)
	}
	tagged, err := remote.Head(tag, remote.WithContext(t.Context()))
	if err != nil {
		t.Fatal(err)
	}
	if tagged.Digest != want {
		t.Errorf("the tag points at %s, want %s", tagged.Digest, want)
	}
	for _, p := range []v1.Platform{amd64, arm64} {
		img, err := remote.Image(pinned, remote.WithContext(t.Context()), remote.WithPlatform(p))
		if err != nil {
			t.Fatalf("%s: %v", p.String(), err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != p.Architecture || cf.Config.User != "65532:65532" {
			t.Errorf("%s: pulled config for %s, user %q", p.String(), cf.Architecture, cf.Config.User)
		}
		layers, err := img.Layers()
		if err != nil {
			t.Fatal(err)
		}
		bin := readLayer(t, layers[len(layers)-1], commitTime)
		if bin["usr/local/bin/imagefleet"].data != string(fakeContent(p)) {
			t.Errorf("%s: the pulled binary is not the one pushed", p.String())
		}
	}
}

func TestPushRejectsName(t *testing.T) {
	idx, err := imagebuild.Index(spec(t, 1, amd64))
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"imagefleet", "127.0.0.1:1/imagefleet", "127.0.0.1:1/imagefleet@sha256:" + strings.Repeat("0", 64)} {
		if _, err := imagebuild.Push(t.Context(), ref, idx, false); err == nil || !strings.Contains(err.Error(), "want registry/repository:tag") {
			t.Errorf("Push(%q): %v, want a refusal of the name", ref, err)
		}
	}
}

// TestArchive: the archive is the layout as one tar, in a fixed order with fixed headers: two writes
// give the same bytes, and unpacked it is a layout holding the same index.
func TestArchive(t *testing.T) {
	idx, err := imagebuild.Index(spec(t, 1, amd64, arm64))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := idx.Digest()
	var a, b bytes.Buffer
	if err := imagebuild.WriteArchive(&a, idx, "imagefleet:test"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	if err := imagebuild.WriteArchive(&b, idx, "imagefleet:test"); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Fatal("two archives of the same index differ")
	}

	dir := t.TempDir()
	tr := tar.NewReader(&a)
	var names []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if !h.ModTime.Equal(time.Unix(0, 0)) || h.Uid != 0 || h.Uname != "" {
			t.Errorf("%s: mtime %v uid %d uname %q", h.Name, h.ModTime, h.Uid, h.Uname)
		}
		path := filepath.Join(dir, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(path, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// layout is the only writer of the entries; the order is what WalkDir gives: lexical.
	if len(names) < 4 || names[0] != "blobs/" || names[len(names)-2] != "index.json" || names[len(names)-1] != "oci-layout" {
		t.Errorf("entries %v: want blobs/..., index.json, oci-layout", names)
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Digest != want {
		t.Fatalf("unpacked index.json lists %v, want only %s", im.Manifests, want)
	}
	anns := im.Manifests[0].Annotations
	if anns["org.opencontainers.image.ref.name"] != "test" || anns["io.containerd.image.name"] != "docker.io/library/imagefleet:test" {
		t.Errorf("index.json names the image %v", anns)
	}
	if _, err := top.ImageIndex(want); err != nil {
		t.Errorf("the index is not in the unpacked blobs: %v", err)
	}
}

func TestWriteLayoutRefuses(t *testing.T) {
	idx, err := imagebuild.Index(spec(t, 1, amd64))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := imagebuild.WriteLayout(dir, idx, "imagefleet:test"); err == nil || !strings.HasSuffix(err.Error(), "not empty") {
		t.Errorf("a non-empty directory: %v, want a refusal", err)
	}
	if err := imagebuild.WriteLayout(t.TempDir(), idx, "imagefleet"); err == nil || !strings.Contains(err.Error(), "want a tag") {
		t.Errorf("a name without a tag: %v, want a refusal", err)
	}
}
