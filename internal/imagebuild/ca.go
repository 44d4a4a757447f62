package imagebuild

import (
	"bytes"
	"encoding/pem"

	"golang.org/x/crypto/x509roots/fallback/bundle"
)

// CABundle returns the Mozilla NSS roots as a PEM bundle, from golang.org/x/crypto/x509roots/fallback,
// the module Go's own fallback roots come from. Its version is pinned in go.mod and its content in
// go.sum, so every machine writes the same bytes for the same commit; the build machine's
// /etc/ssl/certs would differ from one distribution (and one update) to the next, and with it the
// image's digest. Updating the roots is a go.mod change: `go get golang.org/x/crypto/x509roots/fallback@latest`.
//
// Roots that NSS trusts only for certificates issued before a date (distrust-after) are left out: a PEM
// file cannot carry that limit, and trusting them without it would trust what NSS no longer does.
// skipped counts them.
func CABundle() (pemBundle []byte, roots, skipped int) {
	var b bytes.Buffer
	for r := range bundle.Roots() {
		if r.Constraint != nil {
			skipped++
			continue
		}
		// Writing to a bytes.Buffer does not fail.
		_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: r.Certificate})
		roots++
	}
	return b.Bytes(), roots, skipped
}
