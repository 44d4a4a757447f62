package integration_test

import (
	"context"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/detector"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/podsource"
)

// TestPendingPodImagesSurviveGC: a pod bound to node-1 in a real kube-apiserver stays Pending (no kubelet
// runs it), and its image is on the node's real containerd with no container using it. The API server pod
// source puts the pod in the index, and image GC (DeleteUnusedImages, minimum age 0) removes the other
// unused image and keeps the pod's (kubernetes/kubernetes#123631). Once the pod is deleted, GC removes it.
func TestPendingPodImagesSurviveGC(t *testing.T) {
	ctx := t.Context()
	const node = "node-1"
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	bb, err := lab.BusyboxPath()
	if err != nil {
		t.Fatal(err)
	}
	var pushed []lab.Pushed
	for _, repo := range []string{"lab/pending:1", "lab/unused:1"} {
		p, err := lab.Push(ctx, reg.Host(), repo, 2*gcMiB, lab.WithBusybox(bb))
		if err != nil {
			t.Fatal(err)
		}
		pushed = append(pushed, p)
	}
	pending, unused := pushed[0], pushed[1]
	ctr := lab.StartContainerd(t, lab.Options{TmpfsSize: "64m"})
	cl := ctr.Client()
	for _, p := range pushed {
		if _, err := cl.PullImage(ctx, p.Ref, nil, nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	c := kubelab.StartT(t, kubelab.Options{})
	admin, err := c.Admin()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.PrepareNamespace(ctx, "gcp"); err != nil {
		t.Fatal(err)
	}
	_, b := bustest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	psStartIndex(t, b, node, log)
	src, err := podsource.NewAPIServerSource(podsource.APIServerConfig{Node: node, REST: c.NodeConfig(node), Logger: log}, b, b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "apiserver pod source", src.Run)
	d, err := detector.New(detector.Config{Node: node, Period: time.Hour, Logger: log}, cl, b)
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "detector", d.Run)
	var det events.DetectReply
	gcRequest(t, b, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &det)
	g, err := gc.New(gc.Config{Node: node, Policy: gc.Policy{HighThresholdPercent: 85, LowThresholdPercent: 80, MinAge: 0},
		Period: time.Hour, Registerer: prometheus.NewRegistry(), Logger: log}, gc.Deps{Runtime: cl, Bus: b})
	if err != nil {
		t.Fatal(err)
	}
	gcStartWorker(t, "gc", g.Run)

	if _, err := admin.CoreV1().Pods("gcp").Create(ctx, psPod("waiting", node, pending.Ref), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the Pending pod in the index", func() bool {
		pods, _ := psIndex(t, b, node)
		return pods["gcp/waiting"] != ""
	})
	listed := func() []string {
		imgs, err := cl.ListImages(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, im := range imgs {
			ids = append(ids, im.ID)
		}
		return ids
	}
	var res events.GCResult
	gcRequest(t, b, events.CommandSubject(node, events.VerbGC), events.GCRequest{AllUnused: true}, &res)
	t.Logf("gc with the pod Pending: removed %+v, error %q", res.Removed, res.Error)
	if ids := listed(); !slices.Contains(ids, pending.ID) || slices.Contains(ids, unused.ID) {
		t.Fatalf("after GC with the pod Pending: images %v; want %s (the pod's) kept and %s removed", ids, pending.ID, unused.ID)
	}

	if err := psForceDelete(ctx, admin, "gcp", "waiting"); err != nil {
		t.Fatal(err)
	}
	bustest.WaitFor(t, "the deleted pod out of the index", func() bool {
		pods, _ := psIndex(t, b, node)
		return pods["gcp/waiting"] == "" && pods != nil
	})
	res = events.GCResult{}
	gcRequest(t, b, events.CommandSubject(node, events.VerbGC), events.GCRequest{AllUnused: true}, &res)
	if ids := listed(); slices.Contains(ids, pending.ID) {
		t.Fatalf("after the pod was deleted GC kept %s: removed %+v, error %q", pending.ID, res.Removed, res.Error)
	}
}
