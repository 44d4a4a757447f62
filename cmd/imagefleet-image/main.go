// Command imagefleet-image builds imagefleet's container image, one OCI image index over linux/amd64
// and linux/arm64, without Docker and without a base image, and pushes it to a registry or writes it
// as an OCI layout or an OCI archive. The same commit gives the same digest on any machine: see
// docs/image.md.
//
//	go run ./cmd/imagefleet-image --image 127.0.0.1:5000/imagefleet:dev
//	go run ./cmd/imagefleet-image --oci-layout /tmp/imagefleet-oci --revision HEAD
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/imagefleet/imagefleet/internal/imagebuild"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "imagefleet-image:", err)
		os.Exit(1)
	}
}

// errUsage marks a mistake in the flags (exit status 2, as the flag package's own errors).
var errUsage = errors.New("usage")

// config is the command line.
type config struct {
	image, layout, tarball, name string
	platforms                    string
	repo, revision               string
	version, source              string
	insecure                     bool
	sourceDateEpoch              string // the environment's SOURCE_DATE_EPOCH
}

func parse(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("imagefleet-image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.image, "image", "", "push the image index to this `registry/repository:tag` (plain HTTP for loopback and localhost registries, as the lab's 127.0.0.1:5000; credentials from ~/.docker/config.json)")
	fs.StringVar(&c.layout, "oci-layout", "", "write the image index as an OCI image layout into this `directory` (absent or empty)")
	fs.StringVar(&c.tarball, "tarball", "", "write the OCI image layout as one tar `file` (an OCI archive: ctr -n k8s.io images import --all-platforms FILE)")
	fs.StringVar(&c.name, "name", "", "the `name:tag` the layout's and the tarball's index.json give the image (default: --image, else imagefleet:VERSION)")
	fs.StringVar(&c.platforms, "platforms", "linux/amd64,linux/arm64", "comma-separated `os/arch[/variant]` list, one image each in the index")
	fs.StringVar(&c.repo, "repo", ".", "a `directory` in the git working tree to build from")
	fs.StringVar(&c.revision, "revision", "", "the `commit` to build (hash, tag, branch, HEAD); without it: HEAD, refused when the working tree has uncommitted or untracked files, which the image would not contain")
	fs.StringVar(&c.version, "version", "", "the `version` the binaries must report; the build fails otherwise (default: what Go stamps from the commit, the tag vX.Y.Z on it or a pseudo-version)")
	fs.StringVar(&c.source, "source", "", "the org.opencontainers.image.source `URL` (default: https:// and the module path)")
	fs.BoolVar(&c.insecure, "insecure", false, "push over plain HTTP to any registry, not only to loopback and localhost")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: imagefleet-image [--image REF] [--oci-layout DIR] [--tarball FILE] [flags]\n\n"+
			"Builds imagefleet for each platform from a clean checkout of one commit and assembles one OCI image\n"+
			"index, reproducibly (docs/image.md). Prints the index digest (after a push: REF@DIGEST).\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	if c.image == "" && c.layout == "" && c.tarball == "" {
		return c, fmt.Errorf("%w: nothing to write: give --image, --oci-layout or --tarball", errUsage)
	}
	c.sourceDateEpoch = os.Getenv("SOURCE_DATE_EPOCH")
	return c, nil
}

// parsePlatforms parses the --platforms list.
func parsePlatforms(list string) ([]v1.Platform, error) {
	var out []v1.Platform
	seen := map[string]bool{}
	for s := range strings.SplitSeq(list, ",") {
		s = strings.TrimSpace(s)
		p, err := v1.ParsePlatform(s)
		if err != nil || p.OS == "" || p.Architecture == "" || p.OSVersion != "" {
			return nil, fmt.Errorf("--platforms: %q is not os/arch[/variant]", s)
		}
		if seen[p.String()] {
			return nil, fmt.Errorf("--platforms: %s given twice", p.String())
		}
		seen[p.String()] = true
		out = append(out, *p)
	}
	return out, nil
}

// created is the image's creation time: SOURCE_DATE_EPOCH when set (the reproducible-builds
// convention, for a build that must match another tool's), else the commit's time. Never the time of
// the build: that would make every build's digest different.
func created(c config, commit imagebuild.Commit) (time.Time, string, error) {
	if c.sourceDateEpoch == "" {
		return commit.Time, "commit", nil
	}
	sec, err := strconv.ParseInt(c.sourceDateEpoch, 10, 64)
	if err != nil || sec < 0 {
		return time.Time{}, "", fmt.Errorf("SOURCE_DATE_EPOCH=%q: want seconds since the Unix epoch", c.sourceDateEpoch)
	}
	return time.Unix(sec, 0).UTC(), "SOURCE_DATE_EPOCH", nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parse(args, stderr)
	if err != nil {
		return err
	}
	platforms, err := parsePlatforms(c.platforms)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	start := time.Now()

	repo, err := imagebuild.TopLevel(ctx, c.repo)
	if err != nil {
		return fmt.Errorf("--repo %s: %w", c.repo, err)
	}
	rev := c.revision
	if rev == "" {
		// Refuse rather than build HEAD and call it -dirty: an image is built from a commit (its
		// revision annotation names one), and a "-dirty" image could not be built again by anyone.
		changes, err := imagebuild.Changes(ctx, repo)
		if err != nil {
			return err
		}
		if len(changes) > 0 {
			more := ""
			if len(changes) > 5 {
				changes, more = changes[:5], fmt.Sprintf(" and %d more", len(changes)-5)
			}
			return fmt.Errorf("the working tree %s has changes the image would not contain (%s%s): commit them, or build the last commit without them with --revision HEAD",
				repo, strings.Join(changes, ", "), more)
		}
		rev = "HEAD"
	}
	commit, err := imagebuild.ResolveCommit(ctx, repo, rev)
	if err != nil {
		return err
	}
	createdAt, createdFrom, err := created(c, commit)
	if err != nil {
		return err
	}

	tmp, err := os.MkdirTemp("", "imagefleet-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	src := filepath.Join(tmp, "src")
	if err := imagebuild.Checkout(ctx, repo, commit, src); err != nil {
		return err
	}
	mod, err := imagebuild.ReadModule(ctx, src)
	if err != nil {
		return err
	}
	if runtime.Version() != mod.Toolchain {
		// The binaries are built by the pinned toolchain whatever runs this program, but the layers are
		// compressed by this program's compress/flate, whose output may change between Go releases.
		log.Warn("this program was built by another toolchain than go.mod pins: layer compression, and so the digests, may differ from a build by the pinned one",
			"go_version", runtime.Version(), "toolchain", mod.Toolchain)
	}
	log.Info("building", "revision", commit.Hash, "created", createdAt.Format(time.RFC3339), "created_from", createdFrom,
		"toolchain", mod.Toolchain, "platforms", c.platforms)

	spec := imagebuild.Spec{Created: createdAt, Revision: commit.Hash, Source: cmp.Or(c.source, "https://"+mod.Path)}
	for _, p := range platforms {
		t0 := time.Now()
		bin := filepath.Join(tmp, "bin", strings.ReplaceAll(p.String(), "/", "_"), "imagefleet")
		if err := imagebuild.Compile(ctx, src, mod.Toolchain, p, bin); err != nil {
			return err
		}
		st, err := imagebuild.Inspect(bin, p, commit)
		if err != nil {
			return err
		}
		if st.GoVersion != mod.Toolchain {
			return fmt.Errorf("%s binary built by %s, want %s (go.mod)", p.String(), st.GoVersion, mod.Toolchain)
		}
		if spec.Version != "" && st.Version != spec.Version {
			return fmt.Errorf("%s binary reports version %s, the others %s", p.String(), st.Version, spec.Version)
		}
		spec.Version = st.Version
		fi, err := os.Stat(bin)
		if err != nil {
			return err
		}
		log.Info("built binary", "platform", p.String(), "version", st.Version, "bytes", fi.Size(),
			"seconds", time.Since(t0).Round(100*time.Millisecond).Seconds())
		spec.Binaries = append(spec.Binaries, imagebuild.Binary{Platform: p, Path: bin})
	}
	if c.version != "" && c.version != spec.Version {
		return fmt.Errorf("--version %s: the binaries report %s (Go stamps the tag on the commit, else a pseudo-version: tag the commit %s)",
			c.version, spec.Version, c.version)
	}
	var roots, skipped int
	spec.CABundle, roots, skipped = imagebuild.CABundle()
	log.Info("ca bundle", "roots", roots, "skipped_distrust_after", skipped, "bytes", len(spec.CABundle))

	t0 := time.Now()
	idx, err := imagebuild.Index(spec)
	if err != nil {
		return err
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	if err := describe(log, idx); err != nil {
		return err
	}
	log.Info("index", "digest", digest.String(), "version", spec.Version, "seconds", time.Since(t0).Round(100*time.Millisecond).Seconds())

	name := cmp.Or(c.name, c.image, "imagefleet:"+spec.Version)
	if c.layout != "" {
		if err := imagebuild.WriteLayout(c.layout, idx, name); err != nil {
			return err
		}
		log.Info("wrote oci layout", "path", c.layout, "image_ref", name)
	}
	if c.tarball != "" {
		if err := writeTarball(c.tarball, idx, name); err != nil {
			return err
		}
		log.Info("wrote oci archive", "path", c.tarball, "image_ref", name)
	}
	out := digest.String()
	if c.image != "" {
		pinned, err := imagebuild.Push(ctx, c.image, idx, c.insecure)
		if err != nil {
			return err
		}
		log.Info("pushed", "image_ref", c.image)
		out = pinned.String()
	}
	log.Info("done", "seconds", time.Since(start).Round(100*time.Millisecond).Seconds())
	_, err = fmt.Fprintln(stdout, out)
	return err
}

// describe logs each platform's manifest digest and size: the manifest, the config and the compressed
// layers, what a node pulls for it.
func describe(log *slog.Logger, idx v1.ImageIndex) error {
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for _, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			return err
		}
		m, err := img.Manifest()
		if err != nil {
			return err
		}
		size := d.Size + m.Config.Size
		var layers []string
		for _, l := range m.Layers {
			size += l.Size
			layers = append(layers, strconv.FormatInt(l.Size, 10))
		}
		log.Info("image", "platform", d.Platform.String(), "digest", d.Digest.String(), "compressed_bytes", size,
			"layer_bytes", strings.Join(layers, "+"))
	}
	return nil
}

// writeTarball writes the archive next to path and renames it into place, so that an interrupted
// build leaves no truncated archive under the name.
func writeTarball(path string, idx v1.ImageIndex, name string) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-")
	if err != nil {
		return fmt.Errorf("--tarball: %w", err)
	}
	defer os.Remove(f.Name())
	if err := imagebuild.WriteArchive(f, idx, name); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("--tarball: %w", err)
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return fmt.Errorf("--tarball: %w", err)
	}
	return os.Rename(f.Name(), path)
}
