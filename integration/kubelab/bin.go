package kubelab

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/imagefleet/imagefleet/internal/testenv"
)

// Binaries are the programs the lab runs, as deploy/lab/kube/build.sh names them.
var Binaries = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "etcd"}

// buildHint ends every "missing binaries" error.
const buildHint = "build them with deploy/lab/kube/build.sh (as .ci/run does; 6 to 12 minutes on a fresh machine, seconds when cached)"

// ToolsDir finds deploy/lab/kube/tools by walking up from the working directory (a test runs in its
// package's directory).
func ToolsDir() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		tools := filepath.Join(dir, "deploy", "lab", "kube", "tools")
		if _, err := os.Stat(filepath.Join(tools, "go.sum")); err == nil {
			return tools, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("kubelab: deploy/lab/kube/tools not found above the working directory")
		}
		dir = parent
	}
}

// Key is build.sh's cache key: the first 16 hex digits of the SHA-256 of the wrapper's go.mod, go.sum and
// ldflags files, then the Go version and a newline. Keep it in step with build.sh.
func Key(toolsDir, goVersion string) (string, error) {
	h := sha256.New()
	for _, name := range []string{"go.mod", "go.sum", "ldflags"} {
		b, err := os.ReadFile(filepath.Join(toolsDir, name))
		if err != nil {
			return "", fmt.Errorf("kubelab: cache key: %w", err)
		}
		h.Write(b)
	}
	fmt.Fprintf(h, "%s\n", goVersion)
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// BinDir is the directory holding the Binaries: $IMAGEFLEET_KUBE_BIN when set, else
// build.sh's directory for this checkout's key. It returns an error naming the fix when a binary is missing.
func BinDir() (string, error) {
	dir := testenv.Lookup("IMAGEFLEET_KUBE_BIN")
	if dir == "" {
		tools, err := ToolsDir()
		if err != nil {
			return "", err
		}
		key, err := Key(tools, runtime.Version())
		if err != nil {
			return "", err
		}
		dir = filepath.Join(testenv.Lookup("IMAGEFLEET_KUBE_CACHE"), key)
	}
	for _, b := range Binaries {
		fi, err := os.Stat(filepath.Join(dir, b))
		if err != nil || fi.Mode()&0o111 == 0 {
			return "", fmt.Errorf("kubelab: %s not found in %s: %s", b, dir, buildHint)
		}
	}
	return dir, nil
}
