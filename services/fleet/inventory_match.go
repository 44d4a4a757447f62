package fleet

import (
	"strings"

	"github.com/distribution/reference"
)

// imageMatcher matches an image by ID, unique-enough ID prefix, tag or digest reference (normalized the
// way the runtime reports them: nginx is docker.io/library/nginx:latest).
type imageMatcher struct {
	raw, normalized, idPrefix string
}

func newImageMatcher(s string) imageMatcher {
	m := imageMatcher{raw: strings.TrimSpace(s)}
	hexPart := strings.TrimPrefix(m.raw, "sha256:")
	if len(hexPart) >= 6 && isHex(hexPart) {
		m.idPrefix = "sha256:" + hexPart
	}
	if named, err := reference.ParseNormalizedNamed(m.raw); err == nil {
		m.normalized = reference.TagNameOnly(named).String()
	}
	return m
}

func isHex(s string) bool {
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') {
			return false
		}
	}
	return true
}

// isFullID reports whether image is a whole sha256 image ID (a where of it needs no resolving).
func isFullID(image string) bool {
	hexPart, ok := strings.CutPrefix(image, "sha256:")
	return ok && len(hexPart) == 64 && isHex(hexPart)
}
