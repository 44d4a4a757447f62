package imagebuild_test

import (
	"archive/tar"
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/imagefleet/imagefleet/internal/imagebuild"
)

var (
	amd64 = v1.Platform{OS: "linux", Architecture: "amd64"}
	arm64 = v1.Platform{OS: "linux", Architecture: "arm64"}
	// commitTime stands for the commit's time; deliberately not UTC, as time.Unix returns it on a
	// machine whose zone is not UTC.
	commitTime = time.Date(2026, 11, 5, 10, 30, 0, 0, time.FixedZone("CET", 3600))
)

// fakeBinary writes a stand-in for the imagefleet binary of p into dir. Its mode and mtime are
// randomised per call so that a test catches any of them leaking into the image.
func fakeBinary(t *testing.T, dir string, p v1.Platform, seed int) imagebuild.Binary {
	t.Helper()
	path := filepath.Join(dir, p.Architecture, "imagefleet")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, fakeContent(p), os.FileMode(0o700+seed%8)); err != nil {
		t.Fatal(err)
	}
	mt := time.Now().Add(-time.Duration(seed) * time.Hour)
	if err := os.Chtimes(path, mt, mt); err != nil {
		t.Fatal(err)
	}
	return imagebuild.Binary{Platform: p, Path: path}
}

func fakeContent(p v1.Platform) []byte {
	return []byte(strings.Repeat("\x7fELF fake imagefleet for "+p.String()+"\n", 1000))
}

// fakeCA is a small stand-in for the CA bundle: the tests that check the layout need bytes to find,
// not trust anchors (TestCABundle checks the real one).
var fakeCA = []byte("-----BEGIN CERTIFICATE-----\nZmFrZQ==\n-----END CERTIFICATE-----\n")

func spec(t *testing.T, seed int, platforms ...v1.Platform) imagebuild.Spec {
	t.Helper()
	dir := t.TempDir()
	s := imagebuild.Spec{
		CABundle: fakeCA,
		Created:  commitTime,
		Source:   "https://github.com/imagefleet/imagefleet",
		Revision: "0123456789abcdef0123456789abcdef01234567",
		Version:  "v0.0.0-20261105093000-0123456789ab",
	}
	for _, p := range platforms {
		s.Binaries = append(s.Binaries, fakeBinary(t, dir, p, seed))
	}
	return s
}

// writeLayout builds s and writes it as a layout in a new directory, and returns the directory and
// the index's digest as index.json names it.
func writeLayout(t *testing.T, s imagebuild.Spec) (string, v1.Hash) {
	t.Helper()
	idx, err := imagebuild.Index(s)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	if err := imagebuild.WriteLayout(dir, idx, "registry.example/imagefleet:test"); err != nil {
		t.Fatal(err)
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 {
		t.Fatalf("index.json lists %d entries, want 1", len(im.Manifests))
	}
	return dir, im.Manifests[0].Digest
}

// files reads every file under dir, by relative path.
func files(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		rel, _ := filepath.Rel(dir, path)
		out[rel] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestIndexReproducible: two builds from binaries with the same bytes but different paths, file
// modes and mtimes, given in a different order, a second apart, give the same index digest and
// byte-identical layouts; and changing any one input changes the digest.
func TestIndexReproducible(t *testing.T) {
	s1 := spec(t, 1, amd64, arm64)
	dir1, d1 := writeLayout(t, s1)
	time.Sleep(1100 * time.Millisecond) // the clock leaking into a header or the config would show now
	s2 := spec(t, 5, arm64, amd64)
	s2.Created = commitTime.UTC() // the same instant, another zone
	dir2, d2 := writeLayout(t, s2)
	if d1 != d2 {
		t.Fatalf("index digests differ: %s and %s", d1, d2)
	}
	f1, f2 := files(t, dir1), files(t, dir2)
	if !maps.EqualFunc(f1, f2, bytes.Equal) {
		t.Fatalf("layouts differ: %v and %v", slices.Sorted(maps.Keys(f1)), slices.Sorted(maps.Keys(f2)))
	}

	for name, change := range map[string]func(*imagebuild.Spec){
		"revision": func(s *imagebuild.Spec) { s.Revision = strings.Repeat("f", 40) },
		"version":  func(s *imagebuild.Spec) { s.Version = "v0.2.0" },
		"created":  func(s *imagebuild.Spec) { s.Created = s.Created.Add(time.Second) },
		"ca":       func(s *imagebuild.Spec) { s.CABundle = append(slices.Clone(s.CABundle), '\n') },
		"binary": func(s *imagebuild.Spec) {
			if err := os.WriteFile(s.Binaries[0].Path, []byte("other"), 0o755); err != nil {
				t.Fatal(err)
			}
		},
		"platforms": func(s *imagebuild.Spec) { s.Binaries = s.Binaries[:1] },
	} {
		s := spec(t, 1, amd64, arm64)
		change(&s)
		if _, d := writeLayout(t, s); d == d1 {
			t.Errorf("%s changed, index digest did not: %s", name, d)
		}
	}
}

// TestIndexContents reads a layout back as a registry client would and checks what the image
// promises: both platforms, the OCI annotations and labels, the non-root user, the entrypoint without
// arguments, fixed times everywhere, and the files of both layers with their owners and modes.
func TestIndexContents(t *testing.T) {
	s := spec(t, 1, amd64, arm64)
	dir, digest := writeLayout(t, s)
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := top.ImageIndex(digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	wantAnns := map[string]string{
		"org.opencontainers.image.source":   s.Source,
		"org.opencontainers.image.revision": s.Revision,
		"org.opencontainers.image.version":  s.Version,
		"org.opencontainers.image.created":  "2026-11-05T09:30:00Z",
		"org.opencontainers.image.title":    "imagefleet",
	}
	if im.MediaType != types.OCIImageIndex || !maps.Equal(im.Annotations, wantAnns) {
		t.Errorf("index: media type %s, annotations %v; want %s, %v", im.MediaType, im.Annotations, types.OCIImageIndex, wantAnns)
	}
	if raw, err := idx.RawManifest(); err != nil || bytes.Contains(raw, []byte("artifactType")) {
		t.Errorf("index %s (%v): an image's entry has an artifactType, which marks artifacts", raw, err)
	}
	var platforms []string
	var baseLayers []v1.Hash
	for _, m := range im.Manifests {
		p := *m.Platform
		platforms = append(platforms, p.String())
		img, err := idx.Image(m.Digest)
		if err != nil {
			t.Fatal(err)
		}
		mf, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		if mf.MediaType != types.OCIManifestSchema1 || mf.Config.MediaType != types.OCIConfigJSON || !maps.Equal(mf.Annotations, wantAnns) {
			t.Errorf("%s manifest: %s, config %s, annotations %v", p.String(), mf.MediaType, mf.Config.MediaType, mf.Annotations)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		c := cf.Config
		if c.User != "65532:65532" || !slices.Equal(c.Entrypoint, []string{"/usr/local/bin/imagefleet"}) || len(c.Cmd) != 0 ||
			!maps.Equal(c.Labels, wantAnns) || cf.OS != p.OS || cf.Architecture != p.Architecture {
			t.Errorf("%s config: os %s arch %s user %q entrypoint %q cmd %q labels %v", p.String(), cf.OS, cf.Architecture,
				c.User, c.Entrypoint, c.Cmd, c.Labels)
		}
		if !cf.Created.Time.Equal(commitTime) || len(cf.History) != 2 {
			t.Errorf("%s config: created %v, %d history entries; want %v, 2", p.String(), cf.Created, len(cf.History), commitTime)
		}
		for _, h := range cf.History {
			if !h.Created.Time.Equal(commitTime) {
				t.Errorf("%s history %q: created %v, want %v", p.String(), h.CreatedBy, h.Created, commitTime)
			}
		}
		raw, err := img.RawConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(raw, []byte(`"created":"2026-11-05T09:30:00Z"`)) {
			t.Errorf("%s config does not store the creation time in UTC: %s", p.String(), raw)
		}
		layers, err := img.Layers()
		if err != nil {
			t.Fatal(err)
		}
		if len(layers) != 2 {
			t.Fatalf("%s: %d layers, want 2", p.String(), len(layers))
		}
		d, _ := layers[0].Digest()
		baseLayers = append(baseLayers, d)
		base := readLayer(t, layers[0], time.Unix(0, 0))
		bin := readLayer(t, layers[1], commitTime)
		want := map[string]tarFile{
			"etc/":                              {mode: 0o755},
			"etc/group":                         {mode: 0o644, data: "root:x:0:\nimagefleet:x:65532:\n"},
			"etc/passwd":                        {mode: 0o644, data: "root:x:0:0:root:/root:/sbin/nologin\nimagefleet:x:65532:65532:imagefleet:/home/imagefleet:/sbin/nologin\n"},
			"etc/ssl/":                          {mode: 0o755},
			"etc/ssl/certs/":                    {mode: 0o755},
			"etc/ssl/certs/ca-certificates.crt": {mode: 0o644, data: string(fakeCA)},
			"home/":                             {mode: 0o755},
			"home/imagefleet/":                  {mode: 0o700, uid: 65532, gid: 65532},
			"root/":                             {mode: 0o700},
			"tmp/":                              {mode: 0o1777},
		}
		if !maps.Equal(base, want) {
			t.Errorf("%s base layer:\n got %v\nwant %v", p.String(), base, want)
		}
		want = map[string]tarFile{
			"usr/":                     {mode: 0o755},
			"usr/local/":               {mode: 0o755},
			"usr/local/bin/":           {mode: 0o755},
			"usr/local/bin/imagefleet": {mode: 0o755, data: string(fakeContent(p))},
		}
		if !maps.Equal(bin, want) {
			t.Errorf("%s binary layer: got %d entries, want %v (the %s binary)", p.String(), len(bin), slices.Sorted(maps.Keys(want)), p.String())
		}
	}
	if !slices.Equal(platforms, []string{"linux/amd64", "linux/arm64"}) {
		t.Errorf("platforms %v, want linux/amd64 and linux/arm64", platforms)
	}
	if len(baseLayers) == 2 && baseLayers[0] != baseLayers[1] {
		t.Errorf("base layers differ between platforms: %v (one blob should serve both)", baseLayers)
	}
}

type tarFile struct {
	mode     int64
	uid, gid int
	data     string
}

// readLayer reads a layer's tar and fails the test on any header that carries something of the
// build machine: an mtime other than mtime, an access or change time, user or group names.
func readLayer(t *testing.T, l v1.Layer, mtime time.Time) map[string]tarFile {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	out := map[string]tarFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(mtime) || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() || h.Uname != "" || h.Gname != "" || len(h.PAXRecords) > 0 {
			t.Errorf("%s: mtime %v atime %v ctime %v uname %q gname %q pax %v; want mtime %v and nothing else",
				h.Name, h.ModTime, h.AccessTime, h.ChangeTime, h.Uname, h.Gname, h.PAXRecords, mtime)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = tarFile{mode: h.Mode, uid: h.Uid, gid: h.Gid, data: string(b)}
	}
}

func TestIndexRejects(t *testing.T) {
	good := func() imagebuild.Spec { return spec(t, 1, amd64) }
	for name, tc := range map[string]struct {
		change func(*imagebuild.Spec)
		want   string
	}{
		"no binaries":    {func(s *imagebuild.Spec) { s.Binaries = nil }, "image spec: no binaries: want one per platform"},
		"no CA":          {func(s *imagebuild.Spec) { s.CABundle = nil }, "image spec: no CA bundle"},
		"no time":        {func(s *imagebuild.Spec) { s.Created = time.Time{} }, "image spec: no creation time: want the commit's time"},
		"no revision":    {func(s *imagebuild.Spec) { s.Revision = "" }, "image spec: no revision"},
		"twice":          {func(s *imagebuild.Spec) { s.Binaries = append(s.Binaries, s.Binaries[0]) }, "image spec: platform linux/amd64 given twice"},
		"missing binary": {func(s *imagebuild.Spec) { s.Binaries[0].Path += ".gone" }, "image for linux/amd64: read binary: "},
	} {
		t.Run(name, func(t *testing.T) {
			s := good()
			tc.change(&s)
			_, err := imagebuild.Index(s)
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
}

// TestCABundle: the bundle is the NSS roots as PEM, every block a certificate Go can parse, the same
// bytes every call, with a root everyone relies on (Let's Encrypt's) in it and the roots NSS limits by
// a distrust-after date left out.
func TestCABundle(t *testing.T) {
	b, roots, skipped := imagebuild.CABundle()
	again, _, _ := imagebuild.CABundle()
	if !bytes.Equal(b, again) {
		t.Fatal("two calls gave different bundles")
	}
	var subjects []string
	for rest := b; ; {
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			if len(bytes.TrimSpace(rest)) > 0 {
				t.Fatalf("%d bytes after the last PEM block", len(rest))
			}
			break
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatalf("certificate %d: %v", len(subjects), err)
		}
		if !c.IsCA {
			t.Errorf("%s: not a CA", c.Subject)
		}
		subjects = append(subjects, c.Subject.CommonName)
	}
	if len(subjects) != roots || roots < 100 {
		t.Errorf("%d certificates in the bundle, CABundle says %d; want the same, over 100", len(subjects), roots)
	}
	if !slices.Contains(subjects, "ISRG Root X1") {
		t.Error("ISRG Root X1 missing")
	}
	t.Logf("%d roots (%d bytes), %d left out for their distrust-after date", roots, len(b), skipped)
}
