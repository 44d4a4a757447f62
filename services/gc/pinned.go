package gc

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/distribution/reference"

	"github.com/imagefleet/imagefleet/events"
)

// refMatcher matches image records against image references and globs: exact references are normalized
// with the distribution reference grammar (so "busybox" is "docker.io/library/busybox:latest"), image IDs
// match the record's ID, and globs ('*' any run of characters, '/' included; '?' one character) match any
// of the record's names as listed, normalized, or in their familiar form ("busybox:latest").
type refMatcher struct {
	exact map[string]bool
	globs []*regexp.Regexp
}

// newRefMatcher builds a matcher. With strict, an exact pattern that is neither a reference nor an image
// ID is an error (configuration); without, it is kept as a raw string (references read from pod specs).
// Globs are recognised only with strict (the pinned-images setting).
func newRefMatcher(patterns []string, strict bool) (*refMatcher, error) {
	m := &refMatcher{exact: map[string]bool{}}
	for _, p := range patterns {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if strict && strings.ContainsAny(p, "*?") {
			m.globs = append(m.globs, globRE(p))
			continue
		}
		m.exact[p] = true
		if id, ok := parseImageID(p); ok {
			m.exact[id] = true
			continue
		}
		names, err := normalizedForms(p)
		if err != nil {
			if strict {
				return nil, fmt.Errorf("image %q is neither a reference nor an image ID: %w", p, err)
			}
			continue
		}
		for _, n := range names {
			m.exact[n] = true
		}
	}
	return m, nil
}

func (m *refMatcher) empty() bool { return m == nil || (len(m.exact) == 0 && len(m.globs) == 0) }

// match reports whether the record is named by one of the patterns.
func (m *refMatcher) match(r events.ImageRecord) bool {
	if m.empty() {
		return false
	}
	if m.exact[r.ID] {
		return true
	}
	if len(m.globs) > 0 && m.matchGlob(r.ID) {
		return true
	}
	for _, lists := range [][]string{r.RepoTags, r.RepoDigests} {
		for _, name := range lists {
			if m.exact[name] || (len(m.globs) > 0 && m.matchGlob(name)) {
				return true
			}
			forms, err := recordForms(name)
			if err != nil {
				continue
			}
			for _, f := range forms {
				if m.exact[f] || (len(m.globs) > 0 && m.matchGlob(f)) {
					return true
				}
			}
		}
	}
	return false
}

func (m *refMatcher) matchGlob(s string) bool {
	for _, g := range m.globs {
		if g.MatchString(s) {
			return true
		}
	}
	return false
}

// parseImageID recognises "sha256:<64 hex>" and a bare 64-hex ID, returning the "sha256:" form.
func parseImageID(s string) (string, bool) {
	hex := strings.TrimPrefix(s, "sha256:")
	if len(hex) != 64 {
		return "", false
	}
	for _, c := range hex {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return "", false
		}
	}
	return "sha256:" + hex, true
}

// normalizedForms are the forms an exact pattern matches: the full normalized reference with the default
// tag, and for a reference with both tag and digest, the name@digest form runtimes list as RepoDigests.
func normalizedForms(p string) ([]string, error) {
	named, err := reference.ParseNormalizedNamed(p)
	if err != nil {
		return nil, err
	}
	named = reference.TagNameOnly(named)
	out := []string{named.String()}
	if c, ok := named.(reference.Canonical); ok {
		out = append(out, named.Name()+"@"+c.Digest().String())
	}
	return out, nil
}

// recordForms are a record name's normalized and familiar forms.
func recordForms(name string) ([]string, error) {
	named, err := reference.ParseNormalizedNamed(name)
	if err != nil {
		return nil, err
	}
	return []string{named.String(), reference.FamiliarString(named)}, nil
}

func globRE(p string) *regexp.Regexp {
	var b strings.Builder
	b.WriteString("^")
	for _, c := range p {
		switch c {
		case '*':
			b.WriteString(".*")
		case '?':
			b.WriteString(".")
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString("$")
	return regexp.MustCompile(b.String())
}
