package imagebuild

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// Commit is the commit an image is built from.
type Commit struct {
	// Hash is the full commit hash: the image's revision, and the vcs.revision Go stamps into the binary.
	Hash string
	// Time is the committer time, in UTC: what Go stamps as vcs.time and the default creation time.
	Time time.Time
}

// git runs git in dir and returns its standard output without the final newlines (leading spaces are
// meaningful in `git status --porcelain`).
func git(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimRight(stdout.String(), "\n"), nil
}

// TopLevel returns the root of the git working tree holding dir.
func TopLevel(ctx context.Context, dir string) (string, error) {
	return git(ctx, dir, "rev-parse", "--show-toplevel")
}

// Changes lists what `git status` reports in the working tree at dir: modified, staged and untracked
// paths, the same set that makes Go stamp vcs.modified=true. None of it would be in an image built
// from the commit.
func Changes(ctx context.Context, dir string) ([]string, error) {
	out, err := git(ctx, dir, "status", "--porcelain=v1", "--untracked-files=normal")
	if err != nil || out == "" {
		return nil, err
	}
	var paths []string
	for line := range strings.SplitSeq(out, "\n") {
		if len(line) > 3 {
			paths = append(paths, line[3:])
		}
	}
	return paths, nil
}

// ResolveCommit resolves rev (a hash, tag, branch or HEAD) in the repository at dir.
func ResolveCommit(ctx context.Context, dir, rev string) (Commit, error) {
	out, err := git(ctx, dir, "show", "--no-patch", "--no-show-signature", "--format=%H %ct", rev+"^{commit}", "--")
	if err != nil {
		return Commit{}, fmt.Errorf("resolve %q: %w", rev, err)
	}
	hash, ct, ok := strings.Cut(out, " ")
	sec, perr := strconv.ParseInt(ct, 10, 64)
	if !ok || perr != nil || len(hash) < 40 {
		return Commit{}, fmt.Errorf("resolve %q: unexpected git output %q", rev, out)
	}
	return Commit{Hash: hash, Time: time.Unix(sec, 0).UTC()}, nil
}

// Checkout makes dst a clean checkout of commit c of the repository at src: a clone that borrows
// src's objects (--shared: no copy, nothing written in src), detached at c. Building there keeps
// uncommitted changes in src out of the binary and lets Go stamp the commit, clean, into it.
// dst must not exist or be empty.
func Checkout(ctx context.Context, src string, c Commit, dst string) error {
	// autocrlf off: a checkout must not change the sources' bytes, whatever the user's git config says.
	if _, err := git(ctx, src, "-c", "core.autocrlf=false", "clone", "--quiet", "--shared", "--no-checkout", src, dst); err != nil {
		return err
	}
	_, err := git(ctx, dst, "-c", "core.autocrlf=false", "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", c.Hash)
	return err
}
