package imagebuild

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// What the image holds and how it runs.
const (
	// BinaryPath is the entrypoint. The image has no default arguments: each manifest names the
	// subcommand (agent, bus, ...).
	BinaryPath = "/usr/local/bin/imagefleet"
	// CABundlePath is where Go's crypto/x509 looks first on Linux, so no SSL_CERT_FILE is needed.
	CABundlePath = "/etc/ssl/certs/ca-certificates.crt"
	// UserName, UID and GID are the image's default user. The config names it by number, not by name:
	// the kubelet can only check runAsNonRoot against a numeric user. 65532 is the "nonroot" of the
	// distroless images, which the chart's central Deployment runs as.
	UserName = "imagefleet"
	UID      = 65532
	GID      = 65532
)

// The OCI annotation keys the image carries, the same values as config labels, manifest annotations
// and index annotations, so whichever of the three a tool reads, it finds them.
const (
	AnnotationSource   = "org.opencontainers.image.source"
	AnnotationRevision = "org.opencontainers.image.revision"
	AnnotationVersion  = "org.opencontainers.image.version"
	AnnotationCreated  = "org.opencontainers.image.created"
	AnnotationTitle    = "org.opencontainers.image.title"
)

// Binary is the imagefleet executable for one platform.
type Binary struct {
	Platform v1.Platform
	// Path is the file to read. Only its bytes go into the image: its name, mode, owner and times do not.
	Path string
}

// Spec is everything an image index is made of. Index is a pure function of it: the same Spec gives
// the same digests.
type Spec struct {
	// Binaries holds one static binary per platform; the index lists them sorted by platform, so the
	// order given does not change the digest.
	Binaries []Binary
	// CABundle is the PEM bundle written at CABundlePath (see CABundle for a reproducible one).
	CABundle []byte
	// Created is the time in the config, the history and the binary's tar headers: the commit's time
	// (or SOURCE_DATE_EPOCH), never the time of the build. Stored in UTC whatever its location.
	Created time.Time
	// Source, Revision and Version fill the OCI annotations of the same names; all three are required.
	Source, Revision, Version string
}

func (s Spec) validate() error {
	switch {
	case len(s.Binaries) == 0:
		return errors.New("no binaries: want one per platform")
	case len(s.CABundle) == 0:
		return errors.New("no CA bundle")
	case s.Created.IsZero():
		return errors.New("no creation time: want the commit's time")
	case s.Source == "":
		return errors.New("no source")
	case s.Revision == "":
		return errors.New("no revision")
	case s.Version == "":
		return errors.New("no version")
	}
	seen := map[string]bool{}
	for _, b := range s.Binaries {
		p := b.Platform.String()
		if b.Platform.OS == "" || b.Platform.Architecture == "" {
			return fmt.Errorf("binary %q: platform %q lacks an OS or an architecture", b.Path, p)
		}
		if seen[p] {
			return fmt.Errorf("platform %s given twice", p)
		}
		seen[p] = true
	}
	return nil
}

// annotations are the OCI annotations of the index, each manifest, and (as labels) each config.
func (s Spec) annotations() map[string]string {
	return map[string]string{
		AnnotationSource:   s.Source,
		AnnotationRevision: s.Revision,
		AnnotationVersion:  s.Version,
		AnnotationCreated:  s.Created.UTC().Format(time.RFC3339),
		AnnotationTitle:    "imagefleet",
	}
}

// Index builds the image index: one OCI image per binary, each made of a base layer shared by every
// platform (users, groups, CA bundle, /tmp) and a layer holding the binary.
func Index(s Spec) (v1.ImageIndex, error) {
	if err := s.validate(); err != nil {
		return nil, fmt.Errorf("image spec: %w", err)
	}
	base, err := newLayer(baseEntries(s.CABundle), baseTime)
	if err != nil {
		return nil, fmt.Errorf("base layer: %w", err)
	}
	bins := slices.SortedFunc(slices.Values(s.Binaries), func(a, b Binary) int {
		return cmp.Compare(a.Platform.String(), b.Platform.String())
	})
	adds := make([]mutate.IndexAddendum, 0, len(bins))
	for _, b := range bins {
		img, err := image(s, base, b)
		if err != nil {
			return nil, fmt.Errorf("image for %s: %w", b.Platform.String(), err)
		}
		p := b.Platform
		adds = append(adds, mutate.IndexAddendum{Add: imageOnly{img}, Descriptor: v1.Descriptor{Platform: &p}})
	}
	idx := mutate.AppendManifests(empty.Index, adds...)
	idx = mutate.IndexMediaType(idx, types.OCIImageIndex)
	return mutate.Annotations(idx, s.annotations()).(v1.ImageIndex), nil
}

// imageOnly keeps go-containerregistry from giving the image's entry in the index an artifactType (it
// copies the config's media type there, as the referrers API does). The image spec reserves
// artifactType for artifacts; Docker and BuildKit leave it out of image indexes, and a registry or
// client that reads it would take the image for an artifact.
type imageOnly struct{ v1.Image }

// ArtifactType is what partial.Descriptor asks before it would compute one.
func (imageOnly) ArtifactType() (string, error) { return "", nil }

// image builds the image for one platform. The whole config is written here rather than left to
// mutate's defaults, so that nothing in it comes from the machine (mutate would add empty history
// entries, and a zero time marshals differently from an absent one).
func image(s Spec, base layerData, b Binary) (v1.Image, error) {
	data, err := os.ReadFile(b.Path)
	if err != nil {
		return nil, fmt.Errorf("read binary: %w", err)
	}
	bin, err := newLayer(binaryEntries(data), s.Created)
	if err != nil {
		return nil, fmt.Errorf("binary layer: %w", err)
	}
	created := v1.Time{Time: s.Created.UTC()}
	img, err := mutate.Append(mutate.MediaType(empty.Image, types.OCIManifestSchema1),
		mutate.Addendum{Layer: base.layer, MediaType: types.OCILayer},
		mutate.Addendum{Layer: bin.layer, MediaType: types.OCILayer})
	if err != nil {
		return nil, err
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cfg := &v1.ConfigFile{
		Architecture: b.Platform.Architecture,
		OS:           b.Platform.OS,
		Variant:      b.Platform.Variant,
		Created:      created,
		Config: v1.Config{
			User:       strconv.Itoa(UID) + ":" + strconv.Itoa(GID),
			Entrypoint: []string{BinaryPath},
			Env:        []string{"PATH=/usr/local/bin"},
			Labels:     s.annotations(),
		},
		RootFS: v1.RootFS{Type: "layers", DiffIDs: []v1.Hash{base.diffID, bin.diffID}},
		History: []v1.History{
			{Created: created, CreatedBy: "imagefleet-image: /etc/passwd, /etc/group, " + CABundlePath + ", /tmp, /root, /home/" + UserName},
			{Created: created, CreatedBy: "imagefleet-image: " + BinaryPath + " (CGO_ENABLED=0 go build -trimpath -ldflags=\"-s -w\")"},
		},
	}
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return nil, err
	}
	return mutate.Annotations(img, s.annotations()).(v1.Image), nil
}
