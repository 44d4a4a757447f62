package archtest

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// docRef is a reference to a document of the repository: docs/<name>.md, or the top-level README.md.
var docRef = regexp.MustCompile(`\bdocs/[a-z0-9][a-z0-9._/-]*\.md\b`)

// issueRef is how a doc or comment would name an issue of the tracker.
var issueRef = regexp.MustCompile(`(?i)\bissue #?[0-9]+\b`)

// outsideRef names a file that is not in the repository (the first design brief and the shared notes live
// outside it): the contract users read lives in docs/.
var outsideRef = regexp.MustCompile(`\bDESIGN\.md\b|shared/notes/|\.\./shared/`)

// repoFiles lists the repository's docs and Go files (not testdata, not run logs, which record history).
func repoFiles(t *testing.T) (root string, files []string) {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if strings.HasPrefix(d.Name(), ".") && rel != "." || d.Name() == "testdata" || rel == "docs/runs" {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".md") || strings.HasSuffix(path, ".go") || strings.HasSuffix(path, ".yaml") {
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return root, files
}

// TestDocsCiteWhatExists: every docs/*.md that a doc, a comment, a message or a manifest cites exists, none
// cites a file outside the repository, and none names an issue.
func TestDocsCiteWhatExists(t *testing.T) {
	root, files := repoFiles(t)
	if !slices.Contains(files, "docs/architecture.md") {
		t.Fatalf("walked %d files under %s and found no docs/architecture.md", len(files), root)
	}
	missing := map[string][]string{}
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		text := string(data)
		for _, ref := range docRef.FindAllString(text, -1) {
			if _, err := os.Stat(filepath.Join(root, ref)); err != nil {
				missing[ref] = append(missing[ref], f)
			}
		}
		if f == "internal/archtest/docs_test.go" {
			continue // the patterns themselves
		}
		for _, m := range outsideRef.FindAllString(text, -1) {
			t.Errorf("%s cites %q, outside the repository: cite docs/ instead", f, m)
		}
		for _, m := range issueRef.FindAllString(text, -1) {
			t.Errorf("%s names %q: say what is true, not which issue asked for it", f, m)
		}
	}
	for ref, in := range missing {
		slices.Sort(in)
		in = slices.Compact(in)
		t.Errorf("%s does not exist; cited by %s", ref, strings.Join(in, ", "))
	}
}
