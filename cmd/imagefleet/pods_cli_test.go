package main_test

import (
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/events"
)

// TestPodsCommands drives the pod index through the binary: the agent on embedded NATS with a static pod
// directory, then pods apply/get/delete and refs as an operator types them, mirror pods included.
func TestPodsCommands(t *testing.T) {
	dir := t.TempDir()
	manifests := filepath.Join(dir, "manifests")
	if err := os.Mkdir(manifests, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(path, body string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(manifests, "etcd.yaml"), `apiVersion: v1
kind: Pod
metadata: {name: etcd, namespace: kube-system}
spec:
  containers: [{name: etcd, image: registry.k8s.io/etcd:3.5.21-0}]
  volumes: [{name: certs, secret: {secretName: etcd-certs}}]
`)
	port := freePort(t)
	nats := fmt.Sprintf("nats://127.0.0.1:%d", port)
	const node = "node-1.cli"
	startAgent(t, "--node", node, "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", filepath.Join(dir, "data"), "--workers", "podindex", "--pod-manifest-path", manifests)
	cli := func(args ...string) string {
		t.Helper()
		out, errOut, code := run(t, append(args, "--node", node, "--nats", nats)...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s %s", args, code, out, errOut)
		}
		return out
	}
	get := func(args ...string) events.PodsReply {
		t.Helper()
		var rep events.PodsReply
		if err := json.Unmarshal([]byte(cli(append([]string{"pods", "get", "-o", "json"}, args...)...)), &rep); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	names := func(raws []json.RawMessage) []string {
		var out []string
		for _, raw := range raws {
			var p v1.Pod
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatal(err)
			}
			out = append(out, p.Namespace+"/"+p.Name+"="+string(p.UID))
		}
		return out
	}

	// The static source publishes etcd-node-1.cli.
	var static v1.Pod
	bustest.Eventually(t, "the static pod indexed", pollTimeout, func() error {
		out, errOut, code := run(t, "pods", "get", "kube-system/etcd-"+node, "--node", node, "--nats", nats, "-o", "json")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		var rep events.PodsReply
		if err := json.Unmarshal([]byte(out), &rep); err != nil || len(rep.Pods) != 1 {
			return fmt.Errorf("reply %s: %v", out, err)
		}
		return json.Unmarshal(rep.Pods[0], &static)
	})
	if static.Annotations["kubernetes.io/config.source"] != "file" || static.Annotations["kubernetes.io/config.hash"] != string(static.UID) {
		t.Fatalf("static pod annotations %v, uid %s", static.Annotations, static.UID)
	}

	// A mirror pod manifest with no UID gets a UID of its own, never the static pod's; applied again, it
	// updates that mirror pod.
	mirror := filepath.Join(dir, "mirror.yaml")
	write(mirror, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: etcd-%s
  namespace: kube-system
  annotations: {kubernetes.io/config.mirror: %q, kubernetes.io/config.source: api}
spec:
  containers: [{name: etcd, image: registry.k8s.io/etcd:3.5.21-0}]
`, node, static.UID))
	first := cli("pods", "apply", "-f", mirror)
	again := cli("pods", "apply", "-f", mirror)
	if !strings.Contains(first, " added (uid ") || strings.Contains(first, string(static.UID)) || !strings.Contains(again, " updated (uid ") {
		t.Fatalf("mirror apply: %q then %q (static uid %s)", first, again, static.UID)
	}
	rep := get()
	if len(rep.Pods) != 1 || len(rep.MirrorPods) != 1 || len(rep.OrphanedMirrorPods) != 0 {
		t.Fatalf("after the mirror: pods %v mirrors %v orphans %v", names(rep.Pods), names(rep.MirrorPods), rep.OrphanedMirrorPods)
	}
	mirrorUID := rep.PodToMirror[string(static.UID)]
	if mirrorUID == "" || rep.MirrorToPod[mirrorUID] != string(static.UID) {
		t.Fatalf("translations %v / %v", rep.PodToMirror, rep.MirrorToPod)
	}
	if len(rep.StaleMirrorPods) != 0 {
		t.Fatalf("the mirror of the current manifest reads stale: %v", rep.StaleMirrorPods)
	}
	// A mirror pod whose config.mirror is not the static pod's config.hash (an older manifest's) is stale:
	// the kubelet's IsMirrorPodOf is false for it.
	write(mirror+".old", strings.Replace(mustRead(t, mirror), string(static.UID), "0ld", 1))
	cli("pods", "apply", "-f", mirror+".old")
	if rep := get(); len(rep.StaleMirrorPods) != 1 || rep.StaleMirrorPods[0] != mirrorUID {
		t.Fatalf("stale mirror pods %v, want [%s]", rep.StaleMirrorPods, mirrorUID)
	}
	if out := cli("pods", "get"); !strings.Contains(out, "mirror (stale)") {
		t.Fatalf("pods get does not mark the stale mirror:\n%s", out)
	}
	cli("pods", "apply", "-f", mirror)
	if st := get("--source", "file"); len(st.Pods) != 1 || len(st.MirrorPods) != 0 {
		t.Fatalf("--source file: pods %v mirrors %v", names(st.Pods), names(st.MirrorPods))
	}

	// An ordinary pod, its registrations, and refs.
	web := filepath.Join(dir, "web.yaml")
	write(web, `apiVersion: v1
kind: Pod
metadata: {name: web, namespace: prod}
spec:
  imagePullSecrets: [{name: regcred}]
  containers: [{name: app, image: nginx:1.27, envFrom: [{configMapRef: {name: env}}]}]
`)
	cli("pods", "apply", "-f", web)
	refs := cli("refs")
	for _, want := range []string{"Secret     kube-system  etcd-certs  1", "Secret     prod         regcred     1", "ConfigMap  prod         env         1"} {
		if !strings.Contains(refs, want) {
			t.Errorf("refs output lacks %q:\n%s", want, refs)
		}
	}
	// The event feed shows the pod events (their body is the Pod) and says which object a registration is.
	podEvents := cli("events", "--type", "pod")
	if !strings.Contains(podEvents, "imagefleet.pod.added.v1  -  pod prod/web (uid ") ||
		!strings.Contains(podEvents, "pod kube-system/etcd-"+node+" (uid "+string(static.UID)+") added") {
		t.Errorf("events --type pod:\n%s", podEvents)
	}
	if regs := cli("events", "--type", "secret.registered"); !strings.Contains(regs,
		"Registered  Secret prod/regcred registered: first referenced by pod prod/web") {
		t.Errorf("events --type secret.registered:\n%s", regs)
	}
	if page := get("--limit", "2"); len(page.Pods)+len(page.MirrorPods) != 2 || !page.Truncated {
		t.Fatalf("--limit 2: pods %v mirrors %v truncated %v", names(page.Pods), names(page.MirrorPods), page.Truncated)
	}

	// delete by NS/NAME: the pod of that name first, then (none left) its mirror pod.
	cli("pods", "delete", "prod/web")
	cli("pods", "delete", "kube-system/etcd-"+node)
	rep = get()
	if len(rep.Pods) != 0 || len(rep.MirrorPods) != 1 || len(rep.OrphanedMirrorPods) != 1 {
		t.Fatalf("after deleting the static pod: pods %v mirrors %v orphans %v", names(rep.Pods), names(rep.MirrorPods), rep.OrphanedMirrorPods)
	}
	cli("pods", "delete", "kube-system/etcd-"+node)
	if rep = get(); len(rep.Pods)+len(rep.MirrorPods) != 0 {
		t.Fatalf("after deleting the mirror pod: pods %v mirrors %v", names(rep.Pods), names(rep.MirrorPods))
	}
	if refs := cli("refs"); strings.Contains(refs, "regcred") || strings.Contains(refs, "etcd-certs") {
		t.Fatalf("refs after the deletes:\n%s", refs)
	}
	if _, errOut, code := run(t, "pods", "delete", "prod/gone", "--node", node, "--nats", nats); code == 0 || !strings.Contains(errOut, "not in the index") {
		t.Fatalf("deleting an unknown pod: exit %d, %s", code, errOut)
	}

	// A listing bigger than one reply (300 pods of ~2.5 KB: about 1.5 pages): get pages through it.
	var many strings.Builder
	note := strings.Repeat("n", 2400)
	for k := range 300 {
		fmt.Fprintf(&many, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p-%03d, namespace: bulk, annotations: {note: %s}}\n"+
			"spec: {containers: [{name: c, image: busybox}]}\n", k, note)
	}
	bulk := filepath.Join(dir, "bulk.yaml")
	write(bulk, many.String())
	cli("pods", "apply", "-f", bulk)
	all := get()
	if got := names(all.Pods); len(got) != 300 || all.Truncated || !strings.HasPrefix(got[299], "bulk/p-299=") {
		t.Fatalf("get of 300 pods: %d pods, truncated %v", len(got), all.Truncated)
	}
	if some := get("--limit", "250"); len(some.Pods) != 250 || !some.Truncated || !strings.HasPrefix(names(some.Pods)[249], "bulk/p-249=") {
		t.Fatalf("get --limit 250: %d pods, truncated %v", len(some.Pods), some.Truncated)
	}
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
