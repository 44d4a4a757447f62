package imagebuild

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/distribution/reference"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// AnnotationContainerdName is the annotation `ctr images import` names an imported image by.
const AnnotationContainerdName = "io.containerd.image.name"

// refAnnotations are the annotations of the index's entry in a layout's index.json: the tag as
// org.opencontainers.image.ref.name (what skopeo's oci:DIR:TAG reads) and the fully qualified name
// as io.containerd.image.name (what containerd's import reads; without it, ctr makes up a name).
func refAnnotations(ref string) (map[string]string, error) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return nil, fmt.Errorf("image name %q: %w", ref, err)
	}
	tagged, ok := named.(reference.NamedTagged)
	if !ok {
		return nil, fmt.Errorf("image name %q: want a tag (name:tag)", ref)
	}
	return map[string]string{
		"org.opencontainers.image.ref.name": tagged.Tag(),
		AnnotationContainerdName:            tagged.String(),
	}, nil
}

// WriteLayout writes idx as an OCI image layout in dir, which must be absent or empty: index.json
// lists the one index (by its digest, named ref), blobs/sha256 holds it, its manifests, configs and
// layers. Layouts are not merged, so that a layout holds exactly one build.
func WriteLayout(dir string, idx v1.ImageIndex, ref string) error {
	anns, err := refAnnotations(ref)
	if err != nil {
		return err
	}
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		return fmt.Errorf("oci layout %s: not empty", dir)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("oci layout %s: %w", dir, err)
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("oci layout %s: %w", dir, err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(anns)); err != nil {
		return fmt.Errorf("oci layout %s: %w", dir, err)
	}
	return nil
}

// WriteArchive writes idx to w as a tar of the layout WriteLayout writes (an "oci-archive": what
// `ctr images import`, `skopeo copy oci-archive:FILE` and `docker load` read). Entries are in
// lexical order with fixed owners, modes and times, so the same index gives the same archive.
func WriteArchive(w io.Writer, idx v1.ImageIndex, ref string) error {
	tmp, err := os.MkdirTemp("", "imagefleet-archive-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := WriteLayout(tmp, idx, ref); err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	err = filepath.WalkDir(tmp, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == tmp {
			return err
		}
		rel, err := filepath.Rel(tmp, path)
		if err != nil {
			return err
		}
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: baseTime, Format: tar.FormatUSTAR}
		if d.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			return tw.WriteHeader(h)
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		h.Typeflag, h.Mode, h.Size = tar.TypeReg, 0o644, st.Size()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return fmt.Errorf("oci archive: %w", err)
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("oci archive: %w", err)
	}
	return nil
}

// Push writes idx, its manifests and blobs to the registry as ref (a tag) and returns ref pinned to
// the index's digest. Credentials come from the Docker config (~/.docker/config.json and its helpers),
// as for `docker push`. go-containerregistry speaks plain HTTP to loopback and localhost registries
// by itself (the lab's registry on 127.0.0.1:5000); insecure extends that to every host, for a lab
// registry reached by another name.
func Push(ctx context.Context, ref string, idx v1.ImageIndex, insecure bool) (name.Digest, error) {
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	tag, err := name.NewTag(ref, append(opts, name.StrictValidation)...)
	if err != nil {
		return name.Digest{}, fmt.Errorf("image %q: want registry/repository:tag: %w", ref, err)
	}
	d, err := idx.Digest()
	if err != nil {
		return name.Digest{}, err
	}
	if err := remote.WriteIndex(tag, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return name.Digest{}, fmt.Errorf("push %s: %w", tag, err)
	}
	return tag.Context().Digest(d.String()), nil
}
