package kubelab_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
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

// TestControllers: with kube-controller-manager and kube-scheduler, a DaemonSet, a Deployment and a
// StatefulSet with a volumeClaimTemplate become Running pods on the lab's kubelet, the claim is Bound to a
// local volume on node-1 and the pod's write lands in that volume's directory, and a new namespace gets its
// default ServiceAccount and kube-root-ca.crt from the controllers.
func TestControllers(t *testing.T) {
	ctx := t.Context()
	t0 := time.Now()
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	lab.PushBusybox(t, reg.Host(), "lab/pause:1")
	lab.PushBusybox(t, reg.Host(), "lab/app:1")
	ctr := lab.StartContainerd(t, lab.Options{SandboxImage: reg.Ref("lab/pause:1"), TmpfsSize: "256m"})
	c := kubelab.StartWithKubelet(t, ctr, kubelab.Options{Controllers: true})
	t.Logf("lab up after %s", time.Since(t0).Round(time.Millisecond))
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	const ns = "ctl"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(c.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the namespace's default ServiceAccount and kube-root-ca.crt", func() (bool, string) {
		_, saErr := admin.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		cm, cmErr := admin.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		if saErr != nil || cmErr != nil {
			return false, fmt.Sprintf("serviceaccount: %v; configmap: %v", saErr, cmErr)
		}
		if cm.Data["ca.crt"] != string(ca) {
			t.Fatalf("kube-root-ca.crt's ca.crt is not the lab's CA:\n%s", cm.Data["ca.crt"])
		}
		return true, ""
	}, nil)
	vols, err := c.AddLocalVolumes(ctx, 1, "1Gi")
	if err != nil {
		t.Fatal(err)
	}
	if len(vols) != 1 {
		t.Fatalf("AddLocalVolumes made %v, want one volume", vols)
	}

	image := reg.Ref("lab/app:1")
	one := int32(1)
	sleep := []string{"/bin/busybox", "sleep", "3600"}
	if _, err := admin.AppsV1().DaemonSets(ns).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "ds"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "ds"}},
			Template: template("ds", image, sleep),
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.AppsV1().Deployments(ns).Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "deploy"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "deploy"}},
			Template: template("deploy", image, sleep),
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "sts"},
		Spec:       corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Selector: map[string]string{"app": "sts"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	stsTemplate := template("sts", image, []string{"/bin/busybox", "sh", "-c", "echo written-by-sts-0 > /data/proof && exec /bin/busybox sleep 3600"})
	stsTemplate.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	if _, err := admin.AppsV1().StatefulSets(ns).Create(ctx, &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "sts"},
		Spec: appsv1.StatefulSetSpec{
			Replicas:    &one,
			ServiceName: "sts",
			Selector:    &metav1.LabelSelector{MatchLabels: map[string]string{"app": "sts"}},
			Template:    stsTemplate,
			// No storageClassName: the claim gets the default class, AddLocalVolumes's.
			VolumeClaimTemplates: []corev1.PersistentVolumeClaim{{
				ObjectMeta: metav1.ObjectMeta{Name: "data"},
				Spec: corev1.PersistentVolumeClaimSpec{
					AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
					Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("100Mi")}},
				},
			}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	tw := time.Now()
	owners := map[string]string{"ds": "DaemonSet", "deploy": "ReplicaSet", "sts": "StatefulSet"}
	waitFor(t, 90*time.Second, "a Running pod of the DaemonSet, the Deployment and the StatefulSet on node-1, its claim Bound", func() (bool, string) {
		pods, err := admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		running := map[string]bool{}
		var states []string
		for _, p := range pods.Items {
			app := p.Labels["app"]
			states = append(states, fmt.Sprintf("%s(%s) %s on %q", p.Name, app, p.Status.Phase, p.Spec.NodeName))
			if p.Status.Phase != corev1.PodRunning {
				continue
			}
			if p.Spec.NodeName != "node-1" {
				t.Fatalf("pod %s Running on %q, want node-1", p.Name, p.Spec.NodeName)
			}
			if len(p.OwnerReferences) != 1 || p.OwnerReferences[0].Kind != owners[app] {
				t.Fatalf("pod %s (app %s): owners %v, want one %s", p.Name, app, p.OwnerReferences, owners[app])
			}
			running[app] = true
		}
		pvc, err := admin.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data-sts-0", metav1.GetOptions{})
		claim := fmt.Sprint(err)
		if err == nil {
			claim = fmt.Sprintf("%s, volume %q, class %q", pvc.Status.Phase, pvc.Spec.VolumeName, deref(pvc.Spec.StorageClassName))
		}
		ok := running["ds"] && running["deploy"] && running["sts"] && err == nil && pvc.Status.Phase == corev1.ClaimBound
		return ok, fmt.Sprintf("pods %v; claim data-sts-0: %s", states, claim)
	}, func() string { return c.KubeletLogTail(30) })
	t.Logf("the three workloads Running %s after their creation (%s after the test's start)", time.Since(tw).Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))

	pvc, err := admin.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data-sts-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pvc.Spec.VolumeName != vols[0] || deref(pvc.Spec.StorageClassName) != kubelab.LocalStorageClass {
		t.Fatalf("claim data-sts-0 bound to %q of class %q, want %q of class %q", pvc.Spec.VolumeName, deref(pvc.Spec.StorageClassName), vols[0], kubelab.LocalStorageClass)
	}
	pv, err := admin.CoreV1().PersistentVolumes().Get(ctx, vols[0], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pv.Status.Phase != corev1.VolumeBound || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns || pv.Spec.ClaimRef.Name != "data-sts-0" {
		t.Fatalf("volume %s: %s, claim %v; want Bound to %s/data-sts-0", pv.Name, pv.Status.Phase, pv.Spec.ClaimRef, ns)
	}
	proof := filepath.Join(c.LocalVolumeDir(vols[0]), "proof")
	waitFor(t, 10*time.Second, "the StatefulSet pod's write in "+proof, func() (bool, string) {
		b, err := os.ReadFile(proof)
		return err == nil && string(b) == "written-by-sts-0\n", fmt.Sprintf("%q, %v", b, err)
	}, nil)
}

// template is a host-network pod template (the lab has no pod network) labelled app=APP running command.
func template(app, image string, command []string) corev1.PodTemplateSpec {
	grace := int64(1)
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": app}},
		Spec: corev1.PodSpec{
			HostNetwork:                   true,
			DNSPolicy:                     corev1.DNSDefault,
			TerminationGracePeriodSeconds: &grace,
			Containers:                    []corev1.Container{{Name: "app", Image: image, Command: command}},
		},
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// waitFor polls cond every 200 ms until it holds, failing the test after timeout with what cond last said
// and, when diag is set, what diag says (read once, at the failure).
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string), diag func() string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if diag != nil {
				last += "\n" + diag()
			}
			t.Fatalf("%s: not after %s: %s", what, timeout, last)
		}
		select {
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
