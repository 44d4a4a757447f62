package lab

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"
)

// OCI media types of what Push builds.
const (
	mediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
)

// BusyboxCommand is the command of the busybox image: it sleeps until killed, so the image serves as the
// pod sandbox (pause) image and as a long-running container.
var BusyboxCommand = []string{"/bin/busybox", "sleep", "2147483647"}

// Pushed describes an image Push put in a registry.
type Pushed struct {
	// Ref is host/repo:tag.
	Ref string
	// Digest is the manifest digest (sha256:...): what RepoDigests carry.
	Digest string
	// ID is the config digest (sha256:...): the image ID a CRI runtime reports, in ListImages and as a
	// container's ImageID.
	ID string
	// Size is the manifest, the config and the compressed layers together: what containerd reports as the
	// image's size in ListImages.
	Size int64
}

// PushOption adjusts the image Push builds.
type PushOption func(*pushConfig)

type pushConfig struct {
	labels   map[string]string
	layers   int
	user     string
	password string
	busybox  string
	client   *http.Client
}

// WithLabel adds a label to the image config (which changes the image ID).
func WithLabel(key, value string) PushOption {
	return func(c *pushConfig) { c.labels[key] = value }
}

// WithLayers splits the random data over n layers (default 1).
func WithLayers(n int) PushOption {
	return func(c *pushConfig) { c.layers = max(1, n) }
}

// WithAuth pushes with HTTP basic auth (for a registry started with RegistryOptions.User).
func WithAuth(user, password string) PushOption {
	return func(c *pushConfig) { c.user, c.password = user, password }
}

// WithBusybox adds a layer holding the static busybox at path as /bin/busybox (mode 0755) and makes
// BusyboxCommand the image's command.
func WithBusybox(path string) PushOption {
	return func(c *pushConfig) { c.busybox = path }
}

// PushImage pushes an image of about sizeBytes (manifest, config and compressed layers) to the registry at host
// (host:port) as repoTag, and returns its manifest digest. The layer data is random, hence incompressible, so
// the image takes that room in the registry and about twice that on a containerd's image filesystem (the
// compressed blob in the content store plus the unpacked snapshot). The config carries the reference as a
// label, so every repoTag gets a distinct image ID; the data is seeded by repoTag, so pushing the same
// repoTag and size again gives the same digest.
func PushImage(t testing.TB, host, repoTag string, sizeBytes int64, opts ...PushOption) string {
	t.Helper()
	p, err := Push(t.Context(), host, repoTag, sizeBytes, opts...)
	if err != nil {
		t.Fatalf("lab: %v", err)
	}
	return p.Digest
}

// PushBusybox pushes an image whose only layer holds the host's static busybox as /bin/busybox and whose
// command is BusyboxCommand, and returns its manifest digest. It fails the test when busybox-static is not
// installed.
func PushBusybox(t testing.TB, host, repoTag string, opts ...PushOption) string {
	t.Helper()
	bb, err := BusyboxPath()
	if err != nil {
		t.Fatalf("lab: %v", err)
	}
	p, err := Push(t.Context(), host, repoTag, 0, append(opts, WithBusybox(bb))...)
	if err != nil {
		t.Fatalf("lab: %v", err)
	}
	return p.Digest
}

// BusyboxPath finds a statically linked busybox (Debian's busybox-static puts it at /bin/busybox). A
// dynamically linked one would not run in an image without a libc.
func BusyboxPath() (string, error) {
	path := "/bin/busybox"
	if _, err := os.Stat(path); err != nil {
		p, lerr := exec.LookPath("busybox")
		if lerr != nil {
			return "", fmt.Errorf("find busybox: not installed: %s", installHint)
		}
		path = p
	}
	f, err := elf.Open(path)
	if err != nil {
		return "", fmt.Errorf("find busybox: read %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return "", fmt.Errorf("find busybox: %s is dynamically linked; the image needs busybox-static: %s", path, installHint)
		}
	}
	return path, nil
}

// Push builds an image of about size bytes (see PushImage; with WithBusybox the busybox layer comes on top
// of size) and pushes it to the registry at host as repoTag.
//
// It speaks the distribution API itself (two requests a blob, one for the manifest) rather than through
// go-containerregistry's remote package, whose dependencies are not in this module's go.sum.
func Push(ctx context.Context, host, repoTag string, size int64, opts ...PushOption) (Pushed, error) {
	cfg := pushConfig{labels: map[string]string{}, layers: 1, client: http.DefaultClient}
	for _, o := range opts {
		o(&cfg)
	}
	repo, tag := splitRepoTag(repoTag)
	ref := host + "/" + repo + ":" + tag
	im, err := buildImage(ref, size, cfg)
	if err != nil {
		return Pushed{}, fmt.Errorf("push %s: %w", ref, err)
	}
	p := &pusher{ctx: ctx, base: &url.URL{Scheme: "http", Host: host}, repo: repo, cfg: cfg}
	for _, b := range append(im.layers, im.config) {
		if err := p.blob(b); err != nil {
			return Pushed{}, fmt.Errorf("push %s: %w", ref, err)
		}
	}
	if err := p.manifest(tag, im.manifest); err != nil {
		return Pushed{}, fmt.Errorf("push %s: %w", ref, err)
	}
	out := Pushed{Ref: ref, Digest: digestOf(im.manifest), ID: im.config.digest,
		Size: int64(len(im.manifest) + len(im.config.data))}
	for _, l := range im.layers {
		out.Size += int64(len(l.data))
	}
	return out, nil
}

// splitRepoTag splits "repo/path:tag" (default tag "latest").
func splitRepoTag(s string) (repo, tag string) {
	if i := strings.LastIndexByte(s, ':'); i > strings.LastIndexByte(s, '/') {
		return s[:i], s[i+1:]
	}
	return s, "latest"
}

type blob struct {
	data   []byte
	digest string
}

func newBlob(data []byte) blob { return blob{data: data, digest: digestOf(data)} }

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

type image struct {
	layers   []blob
	config   blob
	manifest []byte
}

type descriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
}

// tarGzOverhead is the room a layer's framing takes: a directory header, a file header, the end-of-archive
// blocks, the gzip header and trailer; stored deflate blocks add 5 bytes for each 64 KiB on top.
const tarGzOverhead = 512 + 512 + 1024 + 18

func buildImage(ref string, size int64, cfg pushConfig) (*image, error) {
	im := &image{}
	var diffIDs []string
	add := func(files []tarFile) error {
		data, diffID, err := tarGz(files)
		if err != nil {
			return err
		}
		im.layers = append(im.layers, newBlob(data))
		diffIDs = append(diffIDs, diffID)
		return nil
	}
	var cmd []string
	if cfg.busybox != "" {
		bb, err := os.ReadFile(cfg.busybox)
		if err != nil {
			return nil, fmt.Errorf("read busybox: %w", err)
		}
		files := []tarFile{{name: "bin/", dir: true}, {name: "bin/busybox", data: bb}, {name: "tmp/", dir: true}}
		if err := add(files); err != nil {
			return nil, err
		}
		cmd = BusyboxCommand
	}
	// The random layers fill what the manifest and config (about 1 KiB together) and the framing leave.
	budget := size - 1024
	if cfg.busybox == "" || size > 0 {
		seed := sha256.Sum256([]byte(fmt.Sprintf("%s\x00%d", ref, size)))
		rng := rand.New(rand.NewChaCha8(seed))
		for i := range cfg.layers {
			layer := budget / int64(cfg.layers)
			n := layer - tarGzOverhead - 5*(layer/65535+1)
			if n < 1 {
				n = 1
			}
			data := make([]byte, n)
			fillRandom(rng, data)
			if err := add([]tarFile{{name: "lab/", dir: true}, {name: fmt.Sprintf("lab/data-%d", i), data: data}}); err != nil {
				return nil, err
			}
		}
	}

	labels := map[string]string{"imagefleet.lab/ref": ref}
	for k, v := range cfg.labels {
		labels[k] = v
	}
	config, err := json.Marshal(map[string]any{
		// A fixed time keeps the image ID a function of the reference, size and labels only.
		"created":      time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC),
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Env":    []string{"PATH=/bin"},
			"Cmd":    cmd,
			"Labels": labels,
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	if err != nil {
		return nil, fmt.Errorf("encode image config: %w", err)
	}
	im.config = newBlob(config)
	layers := make([]descriptor, 0, len(im.layers))
	for _, l := range im.layers {
		layers = append(layers, descriptor{MediaType: mediaTypeLayer, Digest: l.digest, Size: int64(len(l.data))})
	}
	im.manifest, err = json.Marshal(struct {
		SchemaVersion int          `json:"schemaVersion"`
		MediaType     string       `json:"mediaType"`
		Config        descriptor   `json:"config"`
		Layers        []descriptor `json:"layers"`
	}{2, mediaTypeManifest, descriptor{mediaTypeConfig, im.config.digest, int64(len(config))}, layers})
	if err != nil {
		return nil, fmt.Errorf("encode image manifest: %w", err)
	}
	return im, nil
}

func fillRandom(rng *rand.Rand, b []byte) {
	for len(b) >= 8 {
		binary.LittleEndian.PutUint64(b, rng.Uint64())
		b = b[8:]
	}
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
}

type tarFile struct {
	name string
	dir  bool
	data []byte
}

// tarGz returns the gzipped tar of files and its diff ID (the digest of the uncompressed tar, which the
// runtime checks while unpacking).
func tarGz(files []tarFile) (data []byte, diffID string, err error) {
	var gz bytes.Buffer
	// No compression: the data is random (or a small binary), and stored blocks keep the compressed size
	// equal to the real size at no CPU cost.
	zw, err := gzip.NewWriterLevel(&gz, gzip.NoCompression)
	if err != nil {
		return nil, "", fmt.Errorf("build layer: %w", err)
	}
	h := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(zw, h))
	mtime := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, f := range files {
		// Mode 0755 on files as well: runc execs /bin/busybox.
		hdr := &tar.Header{Name: f.name, Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX, Typeflag: tar.TypeReg, Size: int64(len(f.data))}
		if f.dir {
			hdr.Typeflag, hdr.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, "", fmt.Errorf("build layer: %w", err)
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, "", fmt.Errorf("build layer: %w", err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, "", fmt.Errorf("build layer: %w", err)
	}
	if err := zw.Close(); err != nil {
		return nil, "", fmt.Errorf("build layer: %w", err)
	}
	return gz.Bytes(), "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

type pusher struct {
	ctx  context.Context
	base *url.URL
	repo string
	cfg  pushConfig
}

func (p *pusher) do(method, u string, body []byte, contentType string, want int) (*http.Response, error) {
	req, err := http.NewRequestWithContext(p.ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.ContentLength = int64(len(body))
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if p.cfg.user != "" {
		req.SetBasicAuth(p.cfg.user, p.cfg.password)
	}
	resp, err := p.cfg.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != want {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("%s %s: %s: %s", method, req.URL.Path, resp.Status, strings.TrimSpace(string(msg)))
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp, nil
}

// blob uploads b in one piece: POST opens an upload, PUT with the digest completes it (both the in-process
// registry and distribution accept this).
func (p *pusher) blob(b blob) error {
	start := p.base.JoinPath("v2", p.repo, "blobs", "uploads").String() + "/"
	resp, err := p.do(http.MethodPost, start, nil, "", http.StatusAccepted)
	if err != nil {
		return fmt.Errorf("upload blob %s: %w", b.digest, err)
	}
	loc, err := url.Parse(resp.Header.Get("Location"))
	if err != nil {
		return fmt.Errorf("upload blob %s: bad Location: %w", b.digest, err)
	}
	u := p.base.ResolveReference(loc)
	q := u.Query()
	q.Set("digest", b.digest)
	u.RawQuery = q.Encode()
	if _, err := p.do(http.MethodPut, u.String(), b.data, "application/octet-stream", http.StatusCreated); err != nil {
		return fmt.Errorf("upload blob %s: %w", b.digest, err)
	}
	return nil
}

func (p *pusher) manifest(tag string, m []byte) error {
	u := p.base.JoinPath("v2", p.repo, "manifests", tag).String()
	if _, err := p.do(http.MethodPut, u, m, mediaTypeManifest, http.StatusCreated); err != nil {
		return fmt.Errorf("put manifest: %w", err)
	}
	return nil
}
