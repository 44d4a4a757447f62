package integration_test

import (
	"encoding/json"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/podsource"
)

// psView is one index's pods: non-mirror pods by namespace/name (UID, config.source) and mirror pods by
// namespace/name (their config.mirror hash).
type psView struct {
	pods    map[string]string // ns/name -> uid
	sources map[string]string // ns/name -> config.source
	mirrors map[string]string // ns/name -> config.mirror
}

func psReadView(t testing.TB, b *bus.Bus, node string) psView {
	t.Helper()
	v := psView{pods: map[string]string{}, sources: map[string]string{}, mirrors: map[string]string{}}
	var rep events.PodsReply
	if err := b.Request(t.Context(), events.QuerySubject(node, events.QryPods), events.PodsQuery{}, &rep); err != nil {
		return v
	}
	for _, raw := range rep.Pods {
		var p v1.Pod
		if err := json.Unmarshal(raw, &p); err != nil {
			t.Fatal(err)
		}
		v.pods[p.Namespace+"/"+p.Name] = string(p.UID)
		v.sources[p.Namespace+"/"+p.Name] = p.Annotations[podindex.ConfigSourceAnnotationKey]
	}
	for _, raw := range rep.MirrorPods {
		var p v1.Pod
		if err := json.Unmarshal(raw, &p); err != nil {
			t.Fatal(err)
		}
		v.mirrors[p.Namespace+"/"+p.Name] = p.Annotations[podindex.ConfigMirrorAnnotationKey]
	}
	return v
}

// TestKubeletPodSourceMatchesAPIServer runs a real kubelet v1.37.2 on the lab's containerd, with an API pod
// and a static pod (and its mirror pod) running, and two pod indexes: one fed by the kubelet Pods API source,
// one by the API server source (node-1's identity). The Pods API source sees the same API pods (same UIDs)
// and the static pod under its kubelet UID, which is the config.hash its mirror pod (seen by the API server
// source) names. Deleting the API pod removes it from both.
func TestKubeletPodSourceMatchesAPIServer(t *testing.T) {
	ctx := t.Context()
	const node = "node-1"
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	lab.PushBusybox(t, reg.Host(), "lab/pause:1")
	lab.PushBusybox(t, reg.Host(), "lab/app:1")
	ctr := lab.StartContainerd(t, lab.Options{SandboxImage: reg.Ref("lab/pause:1"), TmpfsSize: "256m"})
	c := kubelab.StartWithKubelet(t, ctr, kubelab.Options{})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	const ns = "kps"
	if err := c.PrepareNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	_, bk := bustest.Start(t)
	_, ba := bustest.Start(t)
	psStartIndex(t, bk, node, log)
	psStartIndex(t, ba, node, log)
	ks, err := podsource.NewKubeletSource(podsource.KubeletConfig{Node: node, Socket: c.PodsSocket(), Logger: log}, bk, bk)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "kubelet pod source", ks.Run)
	as, err := podsource.NewAPIServerSource(podsource.APIServerConfig{Node: node, REST: c.NodeConfig(node), Logger: log}, ba, ba)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "apiserver pod source", as.Run)

	app := psPod("app", node, reg.Ref("lab/app:1"))
	app.Spec.Containers[0].Command = []string{"/bin/busybox", "sleep", "3600"}
	created, err := admin.CoreV1().Pods(ns).Create(ctx, app, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	static := "apiVersion: v1\nkind: Pod\nmetadata: {name: st, namespace: " + ns + "}\nspec:\n  hostNetwork: true\n  dnsPolicy: Default\n  terminationGracePeriodSeconds: 1\n  containers: [{name: app, image: " + reg.Ref("lab/app:1") + "}]\n"
	if err := os.WriteFile(filepath.Join(c.StaticPodPath(), "st.yaml"), []byte(static), 0o644); err != nil {
		t.Fatal(err)
	}
	var kv, av psView
	psWaitOr := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 60s\nkubelet source's index: %+v\napiserver source's index: %+v\nkubelet log:\n%s", what, kv, av, c.KubeletLogTail(30))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	stName := ns + "/st-" + node
	psWaitOr("both sources see the API pod and the static pod", func() bool {
		kv, av = psReadView(t, bk, node), psReadView(t, ba, node)
		return kv.pods[ns+"/app"] != "" && kv.pods[stName] != "" && av.pods[ns+"/app"] != "" && av.mirrors[stName] != ""
	})
	if kv.pods[ns+"/app"] != string(created.UID) || av.pods[ns+"/app"] != string(created.UID) {
		t.Fatalf("API pod UIDs: kubelet source %s, apiserver source %s, API %s", kv.pods[ns+"/app"], av.pods[ns+"/app"], created.UID)
	}
	if kv.sources[stName] != podindex.FileSource || kv.sources[ns+"/app"] != podindex.ApiserverSource {
		t.Fatalf("kubelet source's config.source annotations: %v", kv.sources)
	}
	if hash := kv.pods[stName]; av.mirrors[stName] != hash {
		t.Fatalf("static pod: the Pods API's UID %s is not the mirror pod's config.mirror %s", hash, av.mirrors[stName])
	}
	if _, ok := av.pods[stName]; ok {
		t.Fatal("the apiserver source's index holds the mirror pod as a pod")
	}
	// The same API pods on both sides.
	apiOnly := func(v psView) map[string]string {
		out := map[string]string{}
		for n, uid := range v.pods {
			if v.sources[n] == podindex.ApiserverSource {
				out[n] = uid
			}
		}
		return out
	}
	if !maps.Equal(apiOnly(kv), apiOnly(av)) {
		t.Fatalf("API pods differ: kubelet source %v, apiserver source %v", apiOnly(kv), apiOnly(av))
	}
	if err := psForceDelete(ctx, admin, ns, "app"); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(c.StaticPodPath(), "st.yaml")); err != nil {
		t.Fatal(err)
	}
	psWaitOr("both sources drop the deleted API pod and the removed static pod", func() bool {
		kv, av = psReadView(t, bk, node), psReadView(t, ba, node)
		return len(kv.pods) == 0 && av.pods[ns+"/app"] == ""
	})
	if ks.Health() != nil || as.Health() != nil {
		t.Fatalf("health: kubelet source %v, apiserver source %v", ks.Health(), as.Health())
	}
}
