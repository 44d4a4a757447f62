package imagebuild

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Package is the main package the image runs.
const Package = "./cmd/imagefleet"

// Module is what the go.mod of a checkout says that matters to the image.
type Module struct {
	// Path is the module path; the default source annotation is https://Path.
	Path string
	// Toolchain is the Go toolchain the module pins: its toolchain line, else go plus its go line.
	// Compile builds with exactly it (GOTOOLCHAIN), downloading it if the machine has another one,
	// because a different compiler writes a different binary.
	Toolchain string
}

// ReadModule reads the go.mod in dir.
func ReadModule(ctx context.Context, dir string) (Module, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "edit", "-json")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return Module{}, fmt.Errorf("go mod edit -json: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	var mf struct {
		Module    struct{ Path string }
		Go        string
		Toolchain string
	}
	if err := json.Unmarshal(out, &mf); err != nil {
		return Module{}, fmt.Errorf("go mod edit -json: %w", err)
	}
	m := Module{Path: mf.Module.Path, Toolchain: mf.Toolchain}
	if m.Toolchain == "" && mf.Go != "" {
		m.Toolchain = "go" + mf.Go
	}
	if m.Path == "" || m.Toolchain == "" {
		return Module{}, fmt.Errorf("go.mod in %s: no module path or no go version", dir)
	}
	return m, nil
}

// archEnv are the per-architecture settings the go command reads from the environment. Compile sets
// each one, to the platform's variant or to empty (the go command's default), so that none leaks in
// from the caller's environment.
var archEnv = []string{"GO386", "GOAMD64", "GOARM", "GOARM64", "GOMIPS", "GOMIPS64", "GOPPC64", "GORISCV64"}

// variantEnv maps an OCI platform variant to the go command's setting for it.
func variantEnv(p v1.Platform) (string, error) {
	v := p.Variant
	switch {
	case v == "":
		if p.Architecture == "arm" {
			return "", fmt.Errorf("platform %s: arm needs a variant (v5, v6 or v7)", p.String())
		}
		return "", nil
	case p.Architecture == "amd64" && (v == "v1" || v == "v2" || v == "v3" || v == "v4"):
		return "GOAMD64=" + v, nil
	case p.Architecture == "arm" && (v == "v5" || v == "v6" || v == "v7"):
		return "GOARM=" + v[1:], nil
	case p.Architecture == "arm64" && v == "v8":
		return "GOARM64=v8.0", nil
	}
	return "", fmt.Errorf("platform %s: variant %q not supported (amd64/v1..v4, arm/v5..v7, arm64/v8)", p.String(), v)
}

// Compile builds Package in the module at dir for platform p into out: static (CGO_ENABLED=0), with
// no paths of the build machine (-trimpath), stripped (-s -w), stamped by Go with the commit dir is
// checked out at (-buildvcs=true), with toolchain and nothing of the caller's GOFLAGS, GOEXPERIMENT
// or architecture settings. dir must be a clean checkout (see Checkout).
//
// The binary reports its version through runtime/debug.ReadBuildInfo (the agent's agentVersion):
// Go sets it from the commit, to the tag vX.Y.Z on the commit if there is one, else to a
// pseudo-version (v0.0.0-<commit time>-<hash prefix>). There is no -X variable to set.
func Compile(ctx context.Context, dir, toolchain string, p v1.Platform, out string) error {
	variant, err := variantEnv(p)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-mod=readonly", "-buildvcs=true", "-trimpath",
		"-ldflags=-s -w", "-o", out, Package)
	cmd.Dir = dir
	// On cancel, interrupt rather than kill: the go command then stops its compilers and removes its
	// work directory.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	env := append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture,
		"GOTOOLCHAIN="+toolchain, "GOFLAGS=", "GOEXPERIMENT=", "GOWORK=off", "GOFIPS140=off")
	for _, k := range archEnv {
		env = append(env, k+"=")
	}
	if variant != "" {
		env = append(env, variant) // later entries win in os/exec
	}
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s for %s: %w\n%s", Package, p.String(), err, stderr.String())
	}
	return nil
}

// Stamp is what Inspect reads back from a binary.
type Stamp struct {
	// Version is the main module's version as the binary reports it.
	Version string
	// GoVersion is the toolchain that built it.
	GoVersion string
}

// Inspect checks that the binary at path is what Compile promises for platform p and commit c: a
// statically linked ELF (no interpreter: it runs in an image without a libc), built for p with cgo
// off and -trimpath, stamped with c and not modified. It returns the version the binary reports.
func Inspect(path string, p v1.Platform, c Commit) (Stamp, error) {
	f, err := elf.Open(path)
	if err != nil {
		return Stamp{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return Stamp{}, fmt.Errorf("inspect %s: dynamically linked (has an ELF interpreter)", path)
		}
	}
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return Stamp{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	want := [][2]string{
		{"CGO_ENABLED", "0"},
		{"GOOS", p.OS},
		{"GOARCH", p.Architecture},
		{"-trimpath", "true"},
		{"vcs.revision", c.Hash},
		{"vcs.modified", "false"},
	}
	got := map[string]string{}
	for _, s := range bi.Settings {
		got[s.Key] = s.Value
	}
	var errs []error
	for _, kv := range want {
		if got[kv[0]] != kv[1] {
			errs = append(errs, fmt.Errorf("%s=%q, want %q", kv[0], got[kv[0]], kv[1]))
		}
	}
	if v := bi.Main.Version; v == "" || v == "(devel)" {
		errs = append(errs, fmt.Errorf("main module version %q: not stamped from the commit", v))
	}
	if err := errors.Join(errs...); err != nil {
		return Stamp{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	return Stamp{Version: bi.Main.Version, GoVersion: bi.GoVersion}, nil
}
