package hollow

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash/fnv"

	"github.com/distribution/reference"
)

// normalize parses ref with the distribution grammar the way containerd's CRI plugin does
// (reference.ParseDockerRef, which is ParseNormalizedNamed + TagNameOnly, and drops the tag of a reference
// that is both tagged and digested): nginx becomes docker.io/library/nginx:latest.
func normalize(ref string) (reference.Named, error) {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return nil, fmt.Errorf("parse image reference %q: %w", ref, err)
	}
	return named, nil
}

// digestOf is the sha256 digest of s in OCI form (sha256:<hex>).
func digestOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// imageID is the deterministic ID of the image a normalized reference pulls: the same reference gives the
// same ID on every node and in every run, as a real registry gives the same config digest.
func imageID(normalized string) string { return digestOf(normalized) }

// manifestDigest stands in for the registry's manifest digest; it differs from the image ID as it does
// for a real image (config digest versus manifest digest).
func manifestDigest(normalized string) string { return digestOf("manifest:" + normalized) }

// repoDigest is the RepoDigests entry for a normalized reference: name@sha256:...
func repoDigest(named reference.Named) string {
	if c, ok := named.(reference.Canonical); ok {
		return named.Name() + "@" + c.Digest().String()
	}
	return named.Name() + "@" + manifestDigest(named.String())
}

const (
	mib            = 1 << 20
	minDefaultSize = 5 * mib
	maxDefaultSize = 300 * mib
)

// defaultImageSize is a deterministic pseudo-random size between 5 and 300 MiB taken from a hash of ref,
// so a fleet of hollow nodes reports the same size for the same image.
func defaultImageSize(ref string) int64 {
	h := fnv.New64a()
	h.Write([]byte(ref))
	return minDefaultSize + int64(h.Sum64()%uint64(maxDefaultSize-minDefaultSize+1))
}

// isHex64 reports whether s is 64 lower-case hex digits: an image ID without its sha256: prefix.
func isHex64(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
