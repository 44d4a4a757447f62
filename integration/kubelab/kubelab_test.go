package kubelab_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
)

func pod(name, node, image string) *corev1.Pod {
	grace := int64(1)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			HostNetwork:                   true,
			DNSPolicy:                     corev1.DNSDefault,
			TerminationGracePeriodSeconds: &grace,
			Containers:                    []corev1.Container{{Name: "app", Image: image}},
		},
	}
}

// TestControlPlane: a node identity sees only its own node's pods, through an apiserver restart; the admin
// sees all; Stop leaves nothing of the directory.
func TestControlPlane(t *testing.T) {
	ctx := t.Context()
	c := kubelab.StartT(t, kubelab.Options{Nodes: []string{"node-1", "node-2"}})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.PrepareNamespace(ctx, "t1"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*corev1.Pod{pod("a", "node-1", "lab/app:1"), pod("b", "node-2", "lab/app:1")} {
		if _, err := admin.CoreV1().Pods("t1").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create pod %s: %v", p.Name, err)
		}
	}
	node1, err := kubernetes.NewForConfig(c.NodeConfig("node-1"))
	if err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		list, err := node1.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=node-1"})
		if err != nil {
			t.Fatalf("%s: list node-1's pods as node-1: %v", when, err)
		}
		if len(list.Items) != 1 || list.Items[0].Name != "a" {
			t.Fatalf("%s: node-1 listed %d pods, want only t1/a: %v", when, len(list.Items), list.Items)
		}
		_, err = node1.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "can only list/watch pods with spec.nodeName field selector") {
			t.Fatalf("%s: node-1 listing every pod: got %v, want the Node authorizer's refusal", when, err)
		}
	}
	check("first start")
	t0 := time.Now()
	if err := c.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("apiserver restarted in %s", time.Since(t0).Round(time.Millisecond))
	check("after restart")
	for _, f := range []string{c.KubeconfigPath("admin"), c.KubeconfigPath("node-1"), c.CAFile()} {
		if _, err := os.Stat(f); err != nil {
			t.Fatal(err)
		}
	}
	dir := c.Dir()
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("after Stop, %s: %v (want it gone)", dir, err)
	}
}

// TestKubelet: a real kubelet on the lab's containerd registers its node, runs an API pod and a static pod
// (with its mirror pod), serves the Pods API socket, and Stop removes its mounts and links.
func TestKubelet(t *testing.T) {
	ctx := t.Context()
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	lab.PushBusybox(t, reg.Host(), "lab/pause:1")
	lab.PushBusybox(t, reg.Host(), "lab/app:1")
	ctr := lab.StartContainerd(t, lab.Options{SandboxImage: reg.Ref("lab/pause:1"), TmpfsSize: "256m"})
	c := kubelab.StartWithKubelet(t, ctr, kubelab.Options{})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.PrepareNamespace(ctx, "t1"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Pods("t1").Create(ctx, pod("a", "node-1", reg.Ref("lab/app:1")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	static := "apiVersion: v1\nkind: Pod\nmetadata: {name: s, namespace: t1}\nspec:\n  hostNetwork: true\n  dnsPolicy: Default\n  terminationGracePeriodSeconds: 1\n  containers: [{name: app, image: " + reg.Ref("lab/app:1") + "}]\n"
	if err := os.WriteFile(filepath.Join(c.StaticPodPath(), "s.yaml"), []byte(static), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		a, aerr := admin.CoreV1().Pods("t1").Get(ctx, "a", metav1.GetOptions{})
		m, merr := admin.CoreV1().Pods("t1").Get(ctx, "s-node-1", metav1.GetOptions{})
		if aerr == nil && merr == nil && a.Status.Phase == corev1.PodRunning && m.Status.Phase == corev1.PodRunning {
			if m.Annotations["kubernetes.io/config.mirror"] == "" {
				t.Fatalf("static pod's mirror has no config.mirror annotation: %v", m.Annotations)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pods not Running after 60s (a: %v, mirror: %v)\n%s", aerr, merr, c.KubeletLogTail(40))
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := os.Stat(c.PodsSocket()); err != nil {
		t.Fatalf("Pods API socket: %v", err)
	}
	root := c.KubeletRoot()
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), root) {
		t.Fatalf("mounts under %s left after Stop", root)
	}
	links, _ := filepath.Glob("/var/log/containers/*")
	for _, l := range links {
		if tgt, _ := os.Readlink(l); strings.HasPrefix(tgt, c.Dir()) {
			t.Fatalf("link %s -> %s left after Stop", l, tgt)
		}
	}
}
