package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "imagefleet-cli-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "imagefleet")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build imagefleet: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t *testing.T) int {
	t.Helper()
	return testport.Free(t)
}

// run runs the binary and returns stdout, stderr and the exit code.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run %v: %v", args, err)
	}
	return stdout.String(), stderr.String(), code
}

type agent struct {
	cmd    *exec.Cmd
	stderr *bytes.Buffer
}

func startAgent(t *testing.T, args ...string) *agent {
	t.Helper()
	cmd := exec.Command(binary, append([]string{"agent"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &agent{cmd: cmd, stderr: &stderr}
	t.Cleanup(func() { a.stop(t) })
	return a
}

// stop sends SIGTERM and expects a clean exit.
func (a *agent) stop(t *testing.T) {
	if a.cmd.ProcessState != nil {
		return
	}
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- a.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("agent exit: %v\n%s", err, a.stderr)
		}
	case <-time.After(20 * time.Second):
		_ = a.cmd.Process.Kill()
		<-done
		t.Errorf("agent did not stop within 20s after SIGTERM\n%s", a.stderr)
	}
}

// pollTimeout is how long a CLI test waits for the agent to answer.
const pollTimeout = 30 * time.Second

// TestAgentOnEmbeddedNATS drives the real binary: the agent with its embedded nats-server (the default), the
// detect, records and images commands in JSON, and a restart that keeps firstDetected.
func TestAgentOnEmbeddedNATS(t *testing.T) {
	rt := hollow.New(hollow.Options{Name: "cli"})
	small, _ := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/busybox:1.36"}, Size: 100})
	big, _ := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/nginx:1.27"}, Size: 300})
	mid, _ := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/redis:7"}, Size: 200})
	if _, err := rt.AddContainer(cri.Container{Name: "web", ImageID: big.ID, State: cri.ContainerExited}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	endpoint, stop, err := rt.StartUnix(t.Context(), filepath.Join(dir, "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	port := freePort(t)
	nats := fmt.Sprintf("nats://127.0.0.1:%d", port)
	agentArgs := []string{"--node", "node-1.cli", "--cri", endpoint, "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", filepath.Join(dir, "data"), "--workers", "detector,cache"}
	a := startAgent(t, agentArgs...)

	var recs []events.ImageRecord
	bustest.Eventually(t, "detect", pollTimeout, func() error {
		out, errOut, code := run(t, "detect", "--node", "node-1.cli", "--nats", nats, "-o", "json", "--timeout", "2s")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		return json.Unmarshal([]byte(out), &recs)
	})
	if len(recs) != 3 || recs[0].ID != big.ID || recs[1].ID != mid.ID || recs[2].ID != small.ID {
		t.Fatalf("records = %+v", recs)
	}
	if !recs[0].InUse || recs[0].LastUsed.IsZero() || recs[1].InUse || recs[0].FirstDetected.IsZero() {
		t.Fatalf("in use / times wrong: %+v", recs)
	}
	first := recs[2].FirstDetected

	var imgs []events.Image
	bustest.Eventually(t, "images", pollTimeout, func() error {
		out, errOut, code := run(t, "images", "--node", "node-1.cli", "--nats", nats, "-o", "json", "--limit", "2")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		return json.Unmarshal([]byte(out), &imgs)
	})
	if len(imgs) != 2 || imgs[0].Size != 300 || imgs[1].Size != 200 {
		t.Fatalf("images = %+v", imgs)
	}
	out, _, code := run(t, "records", "--node", "node-1.cli", "--nats", nats)
	if code != 0 || !strings.Contains(out, "FIRST DETECTED") || !strings.Contains(out, "docker.io/library/redis:7") {
		t.Fatalf("records text (exit %d):\n%s", code, out)
	}

	// Restart on the same data dir: the records come back from the embedded server's JetStream store. This
	// time with the pod index and the metrics endpoint too.
	a.stop(t) // waits for the process to exit: its ports and data dir are free
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	agentArgs[len(agentArgs)-1] = "detector,cache,podindex,metrics"
	startAgent(t, append(agentArgs, "--metrics-addr", metricsAddr)...)
	bustest.Eventually(t, "detect after restart", pollTimeout, func() error {
		out, errOut, code := run(t, "detect", "--node", "node-1.cli", "--nats", nats, "-o", "json", "--timeout", "2s")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		return json.Unmarshal([]byte(out), &recs)
	})
	if len(recs) != 3 || !recs[2].FirstDetected.Equal(first) {
		t.Fatalf("after restart firstDetected of %s = %v, want %v", recs[2].ID, recs[2].FirstDetected, first)
	}

	// A pod through the pod index, then the metrics a scrape shows: the pod index's and the bus's.
	manifest := filepath.Join(dir, "web.yaml")
	if err := os.WriteFile(manifest, []byte(`apiVersion: v1
kind: Pod
metadata: {name: web, namespace: prod, uid: uid-web}
spec:
  containers: [{name: app, image: nginx:1.27}]
  volumes: [{name: tls, secret: {secretName: tls}}]
`), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := run(t, "pods", "apply", "--node", "node-1.cli", "--nats", nats, "-f", manifest); code != 0 {
		t.Fatalf("pods apply: exit %d: %s %s", code, out, errOut)
	}
	want := []string{
		`imagefleet_podindex_events_applied_total{action="added",node="node-1.cli"} 1`,
		`imagefleet_podindex_events_applied_total{action="deleted",node="node-1.cli"} 0`,
		`imagefleet_podindex_ref_transitions_total{action="registered",kind="Secret",node="node-1.cli"} 1`,
		`imagefleet_bus_requests_served_total{subject="imagefleet.cmd.node-1_cli.detect"}`,
		`imagefleet_nats_reconnects_total 0`,
	}
	bustest.Eventually(t, "metrics", pollTimeout, func() error {
		body, status, err := httpGet(t, "http://"+metricsAddr+"/metrics")
		if err != nil || status != 200 {
			return fmt.Errorf("GET /metrics: %d %v", status, err)
		}
		for _, w := range want {
			if !strings.Contains(body, w) {
				return fmt.Errorf("no %q in the scrape", w)
			}
		}
		return nil
	})
	if body, status, err := httpGet(t, "http://"+metricsAddr+"/healthz"); err != nil || status != 200 || body != "ok\n" {
		t.Fatalf("GET /healthz: %d %q %v", status, body, err)
	}
}

func httpGet(t *testing.T, url string) (string, int, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), resp.StatusCode, err
}

func TestBadFlagsExitNonZero(t *testing.T) {
	dataDir := t.TempDir()
	agentGC := []string{"agent", "--node", "n1", "--workers", "gc", "--embedded-nats", "127.0.0.1:-1", "--data-dir", dataDir,
		"--cri", "unix://" + filepath.Join(dataDir, "none.sock")}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"agent", "--node", "Bad_Name"}, "not a DNS-1123 subdomain"},
		{[]string{"agent", "--node", "n1", "--workers", "bogus"}, `unknown worker "bogus"`},
		{[]string{"agent", "--node", "n1", "--event-version", "v3"}, `--event-version: event version "v3" is neither v1 nor v2`},
		{[]string{"records"}, "--node is required"},
		{append(slices.Clone(agentGC), "--kubelet-config", filepath.Join(dataDir, "kubelet.yaml")), "kubelet config: open " + filepath.Join(dataDir, "kubelet.yaml")},
		{append(slices.Clone(agentGC), "--kubelet-coexistence", "both"), `--kubelet-coexistence "both" is neither first-responder nor takeover`},
		{append(slices.Clone(agentGC), "--workers", "heartbeat", "--node-status-report-frequency", "0s"), "nodeStatusReportFrequency (--node-status-report-frequency) 0s: must be above 0"},
		{[]string{"images", "--node", "n1", "-o", "yaml"}, `output "yaml": must be text or json`},
		{[]string{"detect", "--node", "n1", "--nats", "nats://127.0.0.1:1", "--timeout", "300ms"}, "connect to nats"},
	} {
		_, errOut, code := run(t, tc.args...)
		if code == 0 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want %q", tc.args, code, errOut, tc.want)
		}
	}
}

// TestDemo runs the README's first command (`imagefleet demo`, what `go tool task demo` runs): every step on
// the embedded nats-server and the hollow runtime, with the kubelet's reasons for the failing pulls.
func TestDemo(t *testing.T) {
	out, errOut, code := run(t, "demo", "--node", "demo-test", "--images", "16")
	if code != 0 {
		t.Fatalf("demo: exit %d\n%s\n%s", code, out, errOut)
	}
	m := regexp.MustCompile(`16 images \(.*\), \d+ containers keep (\d+) in use`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("demo output lacks the hollow runtime's line:\n%s", out)
	}
	inUse := m[1]
	for _, want := range []string{
		"[9/9] event feed",
		"16 records, " + inUse + " in use",
		"image GC ... removed ",
		"FAILED_IMAGE (Always): InvalidImageName",
		"(Never): ErrImageNeverPull",
		`Warning ErrImageNeverPull: Container image "docker.io/library/traefik:3" is not present with pull policy of Never`,
		"Summary: node demo-test, 16 images detected, " + inUse + " in use; GC freed ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

// TestEventsFromAJournal reads an agent's journal file without NATS: --tail N keeps the last N events that
// match --type (reading the file from its end, so the matches may lie further back than N lines), and a
// damaged line is skipped.
func TestEventsFromAJournal(t *testing.T) {
	var lines []string
	for i := range 50 {
		entity, action, data := events.EntityImage, events.ActionDetected, any(events.ImageRecord{ID: fmt.Sprintf("sha256:%064d", i)})
		if i%10 == 3 {
			entity, action, data = events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: fmt.Sprintf("sha256:%064d", i), Size: 10, Reason: "space"}
		}
		ev, err := events.New("node-j", entity, action, data)
		if err != nil {
			t.Fatal(err)
		}
		raw, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, string(raw))
		if i == 40 {
			lines = append(lines, `{"type":"imagefleet.image.removed.v1","id":`) // a torn line
		}
	}
	path := filepath.Join(t.TempDir(), "events.jsonl")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := run(t, "events", "--journal", path, "--tail", "3", "--type", "image.removed", "-o", "json")
	if code != 0 {
		t.Fatalf("events --journal: exit %d: %s", code, errOut)
	}
	var ids []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		ev, err := events.DecodeEvent([]byte(l))
		if err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		var r events.ImageRemoved
		if err := ev.DecodeData(&r); err != nil || ev.Type != "imagefleet.image.removed.v1" {
			t.Fatalf("event %+v: %v", ev, err)
		}
		ids = append(ids, r.ID[len(r.ID)-2:])
	}
	if want := []string{"23", "33", "43"}; strings.Join(ids, ",") != strings.Join(want, ",") {
		t.Fatalf("last 3 removals %v, want %v", ids, want)
	}
	out, _, code = run(t, "events", "--journal", path, "--tail", "2")
	if code != 0 || strings.Count(out, "\n") != 2 || !strings.Contains(out, "image.detected") {
		t.Fatalf("events --journal --tail 2 (exit %d):\n%s", code, out)
	}
	if _, errOut, code := run(t, "events", "--journal", path, "--follow"); code == 0 || !strings.Contains(errOut, "cannot be used with --journal") {
		t.Fatalf("--follow with --journal: exit %d: %s", code, errOut)
	}
}
