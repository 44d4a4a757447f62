package main_test

import (
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/events"
)

// TestPodsApplyManifestsAndRefusals: pods apply reads manifests as kubectl writes them (a "--- # comment"
// separator, kind: List, a stream of JSON objects) and refuses, with the reason and a non-zero exit, the pods
// the static source would refuse, storing none of a refused file's pods.
func TestPodsApplyManifestsAndRefusals(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	nats := fmt.Sprintf("nats://127.0.0.1:%d", port)
	const node = "node-2.cli"
	startAgent(t, "--node", node, "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", filepath.Join(dir, "data"), "--workers", "podindex")
	write := func(name, body string) string {
		t.Helper()
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	bustest.Eventually(t, "the pod index answers", pollTimeout, func() error {
		if _, errOut, code := run(t, "pods", "get", "--node", node, "--nats", nats); code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		return nil
	})
	apply := func(args ...string) (string, string, int) {
		t.Helper()
		return run(t, append([]string{"pods", "apply", "--node", node, "--nats", nats}, args...)...)
	}

	yamlFile := write("pods.yaml", `apiVersion: v1
kind: Pod
metadata: {name: a, namespace: prod}
spec: {containers: [{name: c, image: nginx:1.27}]}
--- # the second pod
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: prod}
spec: {containers: [{name: c, image: busybox:1}]}
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata: {name: c, namespace: prod}
  spec: {containers: [{name: c, image: busybox:1}]}
- apiVersion: v1
  kind: Pod
  metadata: {name: d}
  spec: {containers: [{name: c, image: busybox:1}]}
`)
	jsonFile := write("pods.json", `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"e","namespace":"prod"},"spec":{"containers":[{"name":"c","image":"busybox:1"}]}}
{"apiVersion":"v1","kind":"Pod","metadata":{"name":"a","namespace":"prod"},"spec":{"containers":[{"name":"c","image":"nginx:1.28"}]}}
`)
	out, errOut, code := apply("-f", yamlFile, "-f", jsonFile, "-o", "json")
	if code != 0 {
		t.Fatalf("apply: exit %d: %s", code, errOut)
	}
	var results []struct{ Action, Namespace, Name, UID string }
	if err := json.Unmarshal([]byte(out), &results); err != nil {
		t.Fatalf("apply -o json: %v\n%s", err, out)
	}
	var got []string
	for _, r := range results {
		got = append(got, r.Action+" "+r.Namespace+"/"+r.Name)
	}
	want := []string{"added prod/a", "added prod/b", "added prod/c", "added default/d", "added prod/e", "updated prod/a"}
	if strings.Join(got, ",") != strings.Join(want, ",") || results[0].UID != results[5].UID {
		t.Fatalf("apply results %v (uids %s, %s), want %v", got, results[0].UID, results[5].UID, want)
	}

	for _, tc := range []struct{ name, pod, want string }{
		{"apps/v1", "apiVersion: apps/v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: c, image: busybox}]}",
			`pod apiVersion "apps/v1" is not v1`},
		{"no containers", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {}", "spec.containers: Required value"},
		{"no image", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: c}]}",
			"spec.containers[0].image: Required value"},
		{"uppercase name", "apiVersion: v1\nkind: Pod\nmetadata: {name: X}\nspec: {containers: [{name: c, image: busybox}]}",
			`metadata.name: Invalid value: "X"`},
		{"duplicate containers", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: c, image: busybox}, {name: c, image: nginx}]}",
			`spec.containers[1].name: Duplicate value: "c"`},
		{"bad image", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: c, image: 'nginx::1'}]}",
			`spec.containers[0].image: Invalid value: "nginx::1": couldn't parse image name`},
		{"pull policy", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: [{name: c, image: busybox, imagePullPolicy: Sometimes}]}",
			`Unsupported value: "Sometimes"`},
	} {
		// A good pod first: nothing of a refused file is stored.
		f := write("bad.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: first-of-bad}\nspec: {containers: [{name: c, image: busybox}]}\n---\n"+tc.pod+"\n")
		out, errOut, code := apply("-f", f)
		if code == 0 || !strings.Contains(errOut, tc.want) || !strings.Contains(errOut, "document 2") || strings.Contains(out, "added") {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want non-zero with %q", tc.name, code, out, errOut, tc.want)
		}
	}
	getOut, errOut, code := run(t, "pods", "get", "--node", node, "--nats", nats, "-o", "json")
	if code != 0 {
		t.Fatalf("get: exit %d: %s", code, errOut)
	}
	var rep events.PodsReply
	if err := json.Unmarshal([]byte(getOut), &rep); err != nil || len(rep.Pods) != 5 {
		t.Fatalf("after the refusals the index holds %d pods (%v), want the 5 applied", len(rep.Pods), err)
	}
}
