package imagebuild_test

import (
	"debug/buildinfo"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/imagefleet/imagefleet/internal/imagebuild"
)

// gitRun runs git in dir with a fixed identity and commit date.
func gitRun(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-c", "user.name=test", "-c", "user.email=test@example.invalid",
		"-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_COMMITTER_DATE=2026-11-05T09:30:00Z", "GIT_AUTHOR_DATE=2026-11-05T09:30:00Z")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// fakeModule makes a git repository holding a module with a ./cmd/imagefleet that prints its version
// and a marker, committed once.
func fakeModule(t *testing.T, marker string) string {
	t.Helper()
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.com/fleet\n\ngo 1.26\n")
	write("cmd/imagefleet/main.go", `package main

import (
	"fmt"
	"runtime/debug"
)

func main() {
	bi, _ := debug.ReadBuildInfo()
	fmt.Println(bi.Main.Version, "`+marker+`")
}
`)
	gitRun(t, dir, "init", "--quiet")
	gitRun(t, dir, "add", ".")
	gitRun(t, dir, "commit", "--quiet", "-m", "fleet")
	return dir
}

func TestSource(t *testing.T) {
	src := fakeModule(t, "committed")
	c, err := imagebuild.ResolveCommit(t.Context(), src, "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	if c.Hash != gitRun(t, src, "rev-parse", "HEAD") || !c.Time.Equal(time.Date(2026, 11, 5, 9, 30, 0, 0, time.UTC)) || c.Time.Location() != time.UTC {
		t.Errorf("ResolveCommit: %+v", c)
	}
	if ch, err := imagebuild.Changes(t.Context(), src); err != nil || len(ch) != 0 {
		t.Errorf("a clean tree: changes %v, %v", ch, err)
	}
	main := filepath.Join(src, "cmd/imagefleet/main.go")
	if err := os.WriteFile(main, []byte("package main\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "new.go"), []byte("package main\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ch, err := imagebuild.Changes(t.Context(), src)
	if err != nil || !slices.Equal(ch, []string{"cmd/imagefleet/main.go", "new.go"}) {
		t.Errorf("changes %v, %v; want the modified and the untracked file", ch, err)
	}
	if _, err := imagebuild.ResolveCommit(t.Context(), src, "no-such-rev"); err == nil {
		t.Error("ResolveCommit of an unknown revision: no error")
	}

	dst := filepath.Join(t.TempDir(), "checkout")
	if err := imagebuild.Checkout(t.Context(), src, c, dst); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dst, "cmd/imagefleet/main.go"))
	if err != nil || !strings.Contains(string(b), "committed") {
		t.Errorf("the checkout holds %q (%v), want the committed main.go", b, err)
	}
	if _, err := os.Stat(filepath.Join(dst, "new.go")); err == nil {
		t.Error("the checkout holds an untracked file of the source tree")
	}
	if ch, err := imagebuild.Changes(t.Context(), dst); err != nil || len(ch) != 0 {
		t.Errorf("the checkout is not clean: %v, %v", ch, err)
	}
}

// TestCompileStampsCommit compiles a small module for this machine's platform from a checkout, with
// the caller's environment set against it (this machine's GOFLAGS=-buildvcs=false, a GOAMD64 level,
// cgo on): the binary is static, stamped with the commit, clean, and reports the pseudo-version, then
// the tag once the commit has one.
func TestCompileStampsCommit(t *testing.T) {
	t.Setenv("GOFLAGS", "-buildvcs=false")
	t.Setenv("GOAMD64", "v3")
	t.Setenv("CGO_ENABLED", "1")
	src := fakeModule(t, "committed")
	c, err := imagebuild.ResolveCommit(t.Context(), src, "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	p := v1.Platform{OS: runtime.GOOS, Architecture: runtime.GOARCH}
	build := func() (string, imagebuild.Stamp) {
		t.Helper()
		dst := filepath.Join(t.TempDir(), "checkout")
		if err := imagebuild.Checkout(t.Context(), src, c, dst); err != nil {
			t.Fatal(err)
		}
		m, err := imagebuild.ReadModule(t.Context(), dst)
		if err != nil || m.Path != "example.com/fleet" || m.Toolchain != "go1.26" {
			t.Fatalf("ReadModule: %+v, %v", m, err)
		}
		bin := filepath.Join(t.TempDir(), "imagefleet")
		if err := imagebuild.Compile(t.Context(), dst, runtime.Version(), p, bin); err != nil {
			t.Fatal(err)
		}
		st, err := imagebuild.Inspect(bin, p, c)
		if err != nil {
			t.Fatal(err)
		}
		return bin, st
	}

	bin, st := build()
	want := "v0.0.0-20261105093000-" + c.Hash[:12]
	if st.Version != want || st.GoVersion != runtime.Version() {
		t.Errorf("stamp %+v, want version %s built by %s", st, want, runtime.Version())
	}
	out, err := exec.Command(bin).Output()
	if err != nil || strings.TrimSpace(string(out)) != want+" committed" {
		t.Errorf("the binary says %q (%v), want %q", out, err, want+" committed")
	}
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range bi.Settings {
		if s.Key == "GOAMD64" && s.Value != "v1" {
			t.Errorf("GOAMD64=%s: the caller's setting leaked into the build", s.Value)
		}
	}
	other := c
	other.Hash = strings.Repeat("0", 40)
	if _, err := imagebuild.Inspect(bin, p, other); err == nil || !strings.Contains(err.Error(), "vcs.revision") {
		t.Errorf("Inspect against another commit: %v, want a vcs.revision mismatch", err)
	}

	gitRun(t, src, "tag", "v0.3.0")
	if _, st := build(); st.Version != "v0.3.0" {
		t.Errorf("a tagged commit: version %s, want v0.3.0", st.Version)
	}
}

func TestCompileRejectsVariant(t *testing.T) {
	for _, tc := range []struct {
		p    v1.Platform
		want string
	}{
		{v1.Platform{OS: "linux", Architecture: "arm64", Variant: "v9"}, `platform linux/arm64/v9: variant "v9" not supported`},
		{v1.Platform{OS: "linux", Architecture: "arm"}, "platform linux/arm: arm needs a variant"},
		{v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v5"}, `platform linux/amd64/v5: variant "v5" not supported`},
	} {
		err := imagebuild.Compile(t.Context(), t.TempDir(), runtime.Version(), tc.p, filepath.Join(t.TempDir(), "x"))
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.p.String(), err, tc.want)
		}
	}
}
