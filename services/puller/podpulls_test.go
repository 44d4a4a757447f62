package puller

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

func podWithImages(uid string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: k8stypes.UID("uid-" + uid), Annotations: map[string]string{"team": "a"}},
		Spec: v1.PodSpec{
			ImagePullSecrets: []v1.LocalObjectReference{{Name: "regcred"}, {Name: ""}},
			InitContainers:   []v1.Container{{Name: "init", Image: "registry.example/init:1", ImagePullPolicy: v1.PullIfNotPresent}},
			Containers: []v1.Container{
				{Name: "app", Image: "registry.example/app:2", ImagePullPolicy: v1.PullAlways},
				{Name: "sidecar", Image: "registry.example/init:1"}, // same image as init: no second request
				{Name: "proxy", Image: "registry.example/proxy:latest"},
			},
			EphemeralContainers: []v1.EphemeralContainer{{EphemeralContainerCommon: v1.EphemeralContainerCommon{Name: "debug", Image: "registry.example/debug:1", ImagePullPolicy: v1.PullNever}}},
		},
	}
}

func TestPodPullRequests(t *testing.T) {
	now := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	pod := podWithImages("1")
	reqs := PodPullRequests(pod, now)
	var got, fields []string
	for _, r := range reqs {
		got = append(got, r.Image+" "+r.Policy)
		if r.Pod != nil {
			fields = append(fields, r.Pod.FieldPath)
		}
		if err := r.Validate(); err != nil {
			t.Errorf("request %+v: %v", r, err)
		}
		if r.Pod == nil || r.Pod.UID != "uid-1" || r.Pod.Namespace != "ns" || r.Pod.Name != "web" {
			t.Errorf("request pod %+v", r.Pod)
		}
		if !slices.Equal(r.Secrets, []string{"regcred"}) || r.Annotations["team"] != "a" || !r.Enqueued.Equal(now) {
			t.Errorf("request %+v: secrets, annotations or enqueue time not the pod's", r)
		}
	}
	want := []string{"registry.example/init:1 IfNotPresent", "registry.example/app:2 Always",
		"registry.example/proxy:latest ", "registry.example/debug:1 Never"}
	if !slices.Equal(got, want) {
		t.Fatalf("requests %q, want %q (spec order, one per image, the container's policy)", got, want)
	}
	// Each request is about its container, as the kubelet's container reference (its events' fieldPath).
	wantFields := []string{"spec.initContainers{init}", "spec.containers{app}", "spec.containers{proxy}",
		"spec.ephemeralContainers{debug}"}
	if !slices.Equal(fields, wantFields) {
		t.Fatalf("field paths %q, want %q", fields, wantFields)
	}
	// The IDs depend on the pod, the container and the image only: the same event twice enqueues nothing new.
	again := PodPullRequests(podWithImages("1"), now.Add(time.Hour))
	other := PodPullRequests(podWithImages("2"), now)
	for i := range reqs {
		if reqs[i].ID != again[i].ID {
			t.Errorf("request %d: id %s then %s for the same pod", i, reqs[i].ID, again[i].ID)
		}
		if reqs[i].ID == other[i].ID {
			t.Errorf("request %d: pods uid-1 and uid-2 share the id %s", i, reqs[i].ID)
		}
	}

	mirror := podWithImages("3")
	mirror.Annotations["kubernetes.io/config.mirror"] = "hash"
	done := podWithImages("4")
	done.Status.Phase = v1.PodSucceeded
	failed := podWithImages("5")
	failed.Status.Phase = v1.PodFailed
	noUID := podWithImages("6")
	noUID.UID = ""
	for name, p := range map[string]*v1.Pod{"mirror": mirror, "succeeded": done, "failed": failed, "no uid": noUID} {
		if r := PodPullRequests(p, now); len(r) != 0 {
			t.Errorf("%s pod: %d requests, want none", name, len(r))
		}
	}
}

// TestPodAddedEnqueuesPulls: with PullOnPodAdd, a pod.added event on the node's subject pulls each of the
// pod's images once, even when the event arrives again and again.
func TestPodAddedEnqueuesPulls(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := newFakeImages("registry.example/init:1")
	startService(t, b, rt, Config{MaxParallelImagePulls: ptr(int32(4)), PullOnPodAdd: true})
	sub := subscribePull(t, b)

	pod := podWithImages("added")
	pod.Spec.EphemeralContainers = nil
	data, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	// The puller subscribes to pod events (core NATS) when it starts: the event is published again and
	// again until the results come, which also delivers it several times.
	subject := events.EventSubject(testNode, events.EntityPod, events.ActionAdded)
	stopPublishing := make(chan struct{})
	published := make(chan int)
	go func() {
		n := 0
		defer func() { published <- n }()
		for {
			if err := b.PublishRaw(subject, data); err == nil {
				n++
			}
			select {
			case <-stopPublishing:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	reqs := PodPullRequests(pod, time.Now())
	var ids []string
	for _, r := range reqs {
		ids = append(ids, r.ID)
	}
	results := collectResults(t, sub, ids, 10*time.Second)
	// The event arrives again after the results: each of its requests is enqueued again (a subscriber to the
	// queue's subject sees every publish, stored or dropped as a duplicate).
	enqueued := subscribeEnqueued(t, b)
	for again := map[string]bool{}; len(again) < len(ids); {
		if id := enqueued(t); slices.Contains(ids, id) {
			again[id] = true
		}
	}
	close(stopPublishing)
	if n := <-published; n < 2 {
		t.Fatalf("the pod event was published %d times, want at least 2", n)
	}
	byImage := map[string]events.PullResult{}
	for _, r := range reqs {
		byImage[r.Image] = results[r.ID]
	}
	if r := byImage["registry.example/init:1"]; r.Error != "" || r.Pulled {
		t.Errorf("init image (present, IfNotPresent): %+v, want present without a pull", r)
	}
	for _, img := range []string{"registry.example/app:2", "registry.example/proxy:latest"} {
		if r := byImage[img]; r.Error != "" || !r.Pulled {
			t.Errorf("%s: %+v, want pulled", img, r)
		}
	}
	// The repeated events' requests were dropped by the stream: no more pulls. A negative check: the sleep
	// gives a wrongly stored request the time to be pulled, and cannot make the test fail.
	time.Sleep(300 * time.Millisecond)
	if n := rt.pulls.Load(); n != 2 {
		t.Errorf("runtime pulls = %d, want 2 (app and proxy, once each)", n)
	}
	st, err := b.Stream(t.Context(), events.PullStreamOf(testNode))
	if err != nil {
		t.Fatal(err)
	}
	if st.LastSeq != uint64(len(reqs)) {
		t.Errorf("requests stored in the pull queue = %d, want %d (the repeated event enqueued nothing)", st.LastSeq, len(reqs))
	}
}

// subscribeEnqueued subscribes to the node's pull queue subject and returns a function that waits for the
// next request published there (stored or dropped as a duplicate) and returns its id.
func subscribeEnqueued(t *testing.T, b *bus.Bus) func(t *testing.T) string {
	t.Helper()
	sub, err := b.SubscribeSync(t.Context(), events.PullSubject(testNode))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return func(t *testing.T) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), bustest.Timeout)
		defer cancel()
		_, data, err := sub.Next(ctx)
		if err != nil {
			t.Fatalf("waiting for a pull request on %s: %v", events.PullSubject(testNode), err)
		}
		var req events.PullRequest
		if err := json.Unmarshal(data, &req); err != nil {
			t.Fatalf("pull request %s: %v", data, err)
		}
		return req.ID
	}
}
