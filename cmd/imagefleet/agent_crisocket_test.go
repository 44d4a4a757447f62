package main_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/cri/socket"
)

// TestAgentWithNoRuntimeSocketExitsNamingEveryPath: with no --cri and no runtime socket under --host-root, the
// agent exits at once with an error naming every path it tried, before it starts NATS, instead of hanging.
func TestAgentWithNoRuntimeSocketExitsNamingEveryPath(t *testing.T) {
	root := t.TempDir()
	start := time.Now()
	_, errOut, code := run(t, "agent", "--node", "n1", "--workers", "gc", "--embedded-nats", "127.0.0.1:-1",
		"--data-dir", t.TempDir(), "--host-root", root)
	took := time.Since(start)
	t.Logf("agent exited %d after %s", code, took.Round(time.Millisecond))
	if code == 0 {
		t.Fatalf("agent exited 0 with no runtime socket; stderr:\n%s", errOut)
	}
	if !strings.Contains(errOut, "find the CRI socket (--cri names one)") {
		t.Errorf("stderr lacks the discovery error:\n%s", errOut)
	}
	for _, c := range socket.Candidates() {
		if p := filepath.Join(root, c.Path); !strings.Contains(errOut, p) {
			t.Errorf("stderr does not name %s:\n%s", p, errOut)
		}
	}
	if strings.Contains(errOut, "embedded nats-server started") {
		t.Errorf("the agent started NATS before it found a runtime:\n%s", errOut)
	}
}

// TestAgentFindsTheRuntimeSocket: with no --cri, a CRI runtime listening at k3s's path under --host-root is
// found and used: the agent's cache lists the runtime's image.
func TestAgentFindsTheRuntimeSocket(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, "run", "k3s", "containerd", "containerd.sock")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	rt := hollow.New(hollow.Options{Name: "k3s"})
	img, _ := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/busybox:1.36"}, Size: 100})
	_, stop, err := rt.StartUnix(t.Context(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	port := freePort(t)
	a := startAgent(t, "--node", "n1", "--workers", "cache", "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", t.TempDir(), "--host-root", root)
	bustest.Eventually(t, "images through the found socket", pollTimeout, func() error {
		out, errOut, code := run(t, "images", "--node", "n1", "--nats", fmt.Sprintf("nats://127.0.0.1:%d", port), "-o", "json", "--timeout", "2s")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		if !strings.Contains(out, img.ID) {
			return fmt.Errorf("images lack %s: %s", img.ID, out)
		}
		return nil
	})
	a.stop(t)
	if log := a.stderr.String(); !strings.Contains(log, "cri socket found") || !strings.Contains(log, "unix://"+path) {
		t.Errorf("the agent's log does not say which socket it found:\n%s", log)
	}
}
