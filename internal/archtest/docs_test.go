package archtest

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
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

// outsideRef names a file that is not in the repository (the first design brief, DESIGN.md, and the shared
// notes live outside it), however it is cited ("DESIGN.md", "DESIGN's contract", "shared/notes/x.md",
// "../shared/"): the contract users read lives in docs/.
var outsideRef = regexp.MustCompile(`\bDESIGN\b|\bshared/notes\b|\.\./shared\b`)

// skipped reports whether rel (slash-separated, relative to the root) is left out of the scan: testdata
// (fixtures, fuzz corpora) and the run logs of docs/runs, which record history.
func skipped(rel string) bool {
	for _, dir := range strings.Split(path.Dir(rel), "/") {
		if dir == "testdata" {
			return true
		}
	}
	return rel == "docs/runs" || strings.HasPrefix(rel, "docs/runs/")
}

// repoFiles lists the repository's text files, every kind (docs, Go, YAML, shell, templates, TOML, the
// Taskfile ...), not testdata and not run logs: the files git tracks when git can list them, else every file
// under the root outside dot directories. A file with a NUL byte in its first 8 KiB is binary and left out.
func repoFiles(t *testing.T) (root string, files []string) {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	if out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output(); err == nil && len(out) > 0 {
		listed = strings.Split(strings.TrimRight(string(out), "\x00"), "\x00")
	} else {
		// No git, not a work tree, or one git refuses ("dubious ownership"): the walk sees untracked files
		// too and skips dot directories (.ci, .github), so say which listing this run checked.
		t.Logf("git ls-files did not list the files (%v); walking %s instead", err, root)
		err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			if d.IsDir() {
				if strings.HasPrefix(d.Name(), ".") && rel != "." {
					return filepath.SkipDir
				}
				return nil
			}
			if d.Type().IsRegular() {
				listed = append(listed, filepath.ToSlash(rel))
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, rel := range listed {
		if skipped(rel) || !isText(t, filepath.Join(root, filepath.FromSlash(rel))) {
			continue
		}
		files = append(files, rel)
	}
	return root, files
}

// isText reports whether the file at p is a regular file (a symbolic link followed) with no NUL byte in its
// first 8 KiB. A tracked path deleted in the work tree, a link to a directory or a submodule is not.
func isText(t *testing.T, p string) bool {
	t.Helper()
	fi, err := os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	if !fi.Mode().IsRegular() {
		return false
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	head := make([]byte, 8<<10)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatal(err)
	}
	return !bytes.Contains(head[:n], []byte{0})
}

// TestDocsCiteWhatExists: every docs/*.md that a doc, a comment, a message, a manifest or a script cites
// exists, no text file cites a file outside the repository, and none names an issue.
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
