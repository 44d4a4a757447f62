package podindex

import (
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// podApply sends a podapply request as `imagefleet pods apply` does.
func podApply(t *testing.T, b *bus.Bus, req events.PodApplyRequest, pods ...*v1.Pod) (events.PodApplyReply, error) {
	t.Helper()
	for _, p := range pods {
		raw, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		req.Pods = append(req.Pods, raw)
	}
	var rep events.PodApplyReply
	err := b.Request(t.Context(), events.CommandSubject(testNode, events.VerbPodApply), req, &rep)
	return rep, err
}

// TestApplyDecidesAddedOrUpdatedAtomically: concurrent applies of one new pod without a UID store one
// pod.added and the rest pod.updated, all with the one UID the index chose; with Wait the reply comes once
// the index applied the events.
func TestApplyDecidesAddedOrUpdatedAtomically(t *testing.T) {
	b := startBus(t)
	defer goleak.VerifyNone(t, bustest.IgnoreServer(goleak.IgnoreCurrent())...)
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 50 * time.Millisecond})
	defer stop()

	const n = 8
	var wg sync.WaitGroup
	reps := make([]events.PodApplyReply, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			reps[i], errs[i] = podApply(t, b, events.PodApplyRequest{Op: events.PodApply, Wait: true},
				testPod("prod", "web", "", []string{"tls"}, nil, "nginx:1.27"))
		})
	}
	wg.Wait()
	added, uids := 0, map[string]bool{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("apply %d: %v", i, errs[i])
		}
		if len(reps[i].Results) != 1 || reps[i].Seq == 0 || reps[i].AppliedSeq < reps[i].Seq {
			t.Fatalf("apply %d: reply %+v", i, reps[i])
		}
		r := reps[i].Results[0]
		if r.Action == events.ActionAdded {
			added++
		} else if r.Action != events.ActionUpdated {
			t.Fatalf("apply %d: action %q", i, r.Action)
		}
		uids[r.UID] = true
	}
	if added != 1 || len(uids) != 1 {
		t.Fatalf("%d concurrent applies: %d added, UIDs %v; want 1 added and one UID", n, added, uids)
	}
	if pods, mirrors := s.State().Index.size(); pods != 1 || mirrors != 0 {
		t.Fatalf("index holds %d pods, %d mirror pods", pods, mirrors)
	}

	// One request naming a pod twice: added, then updated with the same UID; delete by name removes it.
	rep, err := podApply(t, b, events.PodApplyRequest{Op: events.PodApply, Wait: true},
		testPod("prod", "job", "", nil, nil, "busybox:1"), testPod("prod", "job", "", nil, nil, "busybox:2"))
	if err != nil || len(rep.Results) != 2 || rep.Results[0].Action != events.ActionAdded ||
		rep.Results[1].Action != events.ActionUpdated || rep.Results[0].UID != rep.Results[1].UID {
		t.Fatalf("a pod twice in one request: %+v, %v", rep, err)
	}
	if got, ok := s.State().Index.getPodByName("prod", "job"); !ok || got.Spec.Containers[0].Image != "busybox:2" {
		t.Fatalf("after the request the index has %v", got)
	}
	jobUID := rep.Results[0].UID
	named := &v1.Pod{}
	named.Namespace, named.Name = "prod", "job"
	rep, err = podApply(t, b, events.PodApplyRequest{Op: events.PodDelete, ByName: true, Wait: true}, named)
	if err != nil || len(rep.Results) != 1 || rep.Results[0].Action != events.ActionDeleted || rep.Results[0].UID != jobUID {
		t.Fatalf("delete by name: %+v, %v", rep, err)
	}
	if _, ok := s.State().Index.getPodByName("prod", "job"); ok {
		t.Fatal("prod/job still indexed after its delete was acknowledged with wait")
	}
	if _, err := podApply(t, b, events.PodApplyRequest{Op: events.PodDelete, ByName: true}, named); err == nil ||
		!strings.Contains(err.Error(), "pod prod/job is not in the index of "+testNode+" and has no uid to delete") {
		t.Fatalf("deleting an unknown pod: %v", err)
	}
}

// TestApplyRefusesInvalidPods: the index checks every pod as the static source checks a manifest, refuses
// the whole request with the reason, and stores nothing.
func TestApplyRefusesInvalidPods(t *testing.T) {
	b := startBus(t)
	s, stop := startService(t, b, Config{Node: testNode, FlushInterval: 50 * time.Millisecond})
	defer stop()
	good := testPod("prod", "ok", "", nil, nil, "nginx:1.27")
	for _, tc := range []struct {
		name string
		pod  func(p *v1.Pod)
		want string
	}{
		{"apps/v1", func(p *v1.Pod) { p.APIVersion = "apps/v1" }, `pod apiVersion "apps/v1" is not v1`},
		{"not a pod", func(p *v1.Pod) { p.Kind = "Deployment" }, `a "Deployment", not a Pod`},
		{"no containers", func(p *v1.Pod) { p.Spec.Containers = nil }, "spec.containers: Required value"},
		{"no image", func(p *v1.Pod) { p.Spec.Containers[0].Image = "" }, "spec.containers[0].image: Required value"},
		{"uppercase name", func(p *v1.Pod) { p.Name = "Web" }, `metadata.name: Invalid value: "Web": a lowercase RFC 1123 subdomain`},
		{"duplicate container", func(p *v1.Pod) { p.Spec.Containers = append(p.Spec.Containers, p.Spec.Containers[0]) },
			`spec.containers[1].name: Duplicate value: "c"`},
		{"bad image reference", func(p *v1.Pod) { p.Spec.Containers[0].Image = "Nginx:1.27" },
			`spec.containers[0].image: Invalid value: "Nginx:1.27": couldn't parse image name`},
		{"pull policy", func(p *v1.Pod) { p.Spec.Containers[0].ImagePullPolicy = "Sometimes" },
			`spec.containers[0].imagePullPolicy: Unsupported value: "Sometimes": supported values: "Always", "IfNotPresent", "Never"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := testPod("prod", "bad", "", nil, nil, "nginx:1.27")
			tc.pod(bad)
			before := s.State().Applied()
			_, err := podApply(t, b, events.PodApplyRequest{Op: events.PodApply, Wait: true}, good, bad)
			if !errors.Is(err, bus.ErrRemote) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want a refusal with %q", err, tc.want)
			}
			if _, ok := s.State().Index.getPodByName("prod", "ok"); ok || s.State().Applied() != before {
				t.Fatal("a refused request stored a pod")
			}
		})
	}
}
