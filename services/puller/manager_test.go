package puller

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/imagefleet/imagefleet/events"
)

type step struct {
	calls  []string
	err    error
	events []string
	msg    string // substring of the returned message
}

type pullCase struct {
	name   string
	image  string
	policy string
	// pullErr / inspectErr: the fake runtime's Err and InspectErr.
	pullErr, inspectErr error
	qps                 float64
	burst               int
	creds               credentialSource
	seed                func(*memRecords)
	steps               []step
	// metric: (pull_policy, present_locally, pull_required) of the first step.
	metric [3]string
}

var (
	callsPull  = []string{"GetImageRef", "PullImage", "GetImageSize"}
	callsRef   = []string{"GetImageRef"}
	callsAlway = []string{"PullImage", "GetImageSize"}
)

func repeat(s step, n int) []step {
	out := make([]step, n)
	for i := range out {
		out[i] = s
	}
	return out
}

// noFGPullerTestCases are the kubelet's noFGPullerTestCases (C1..C12).
func noFGPullerTestCases() []pullCase {
	return []pullCase{
		{name: "image missing, pull", image: "missing_image", policy: events.PullIfNotPresent,
			steps:  []step{{calls: callsPull, events: []string{"Pulling", "Pulled"}, msg: ""}},
			metric: [3]string{"ifnotpresent", "false", "true"}},
		{name: "image present, allow all, don't pull", image: "present_image", policy: events.PullIfNotPresent,
			steps:  repeat(step{calls: callsRef, events: []string{"Pulled"}, msg: "already present on machine"}, 3),
			metric: [3]string{"ifnotpresent", "true", "false"}},
		{name: "image present, pull", image: "present_image", policy: events.PullAlways,
			steps:  repeat(step{calls: callsAlway, events: []string{"Pulling", "Pulled"}}, 3),
			metric: [3]string{"always", "unknown", "true"}},
		{name: "image missing, never pull", image: "missing_image", policy: events.PullNever,
			steps: repeat(step{calls: callsRef, err: ErrImageNeverPull, events: []string{"ErrImageNeverPull"},
				msg: `Container image "missing_image" is not present with pull policy of Never`}, 3),
			metric: [3]string{"never", "false", "unknown"}},
		{name: "image missing, pull if not present, fail on image inspect", image: "missing_image", policy: events.PullIfNotPresent,
			inspectErr: errors.New("unknown inspectError"),
			steps: repeat(step{calls: callsRef, err: ErrImageInspect, events: []string{"InspectFailed"},
				msg: `Failed to inspect image "": unknown inspectError`}, 3),
			metric: [3]string{"ifnotpresent", "unknown", "unknown"}},
		{name: "image missing, unable to fetch", image: "typo_image", policy: events.PullIfNotPresent, pullErr: errors.New("404"),
			steps: []step{
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrImagePull, events: []string{"Pulling", "Failed"}, msg: "404"},
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrImagePull, events: []string{"Pulling", "Failed"}, msg: "404"},
				{calls: callsRef, err: ErrImagePullBackOff, events: []string{"BackOff"}, msg: `Back-off pulling image "typo_image": ErrImagePull: 404`},
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrImagePull, events: []string{"Pulling", "Failed"}, msg: "404"},
				{calls: callsRef, err: ErrImagePullBackOff, events: []string{"BackOff"}, msg: "Back-off pulling image"},
				{calls: callsRef, err: ErrImagePullBackOff, events: []string{"BackOff"}, msg: "Back-off pulling image"},
			},
			metric: [3]string{"ifnotpresent", "false", "true"}},
		{name: "image present and qps>0, pull", image: "present_image", policy: events.PullAlways, qps: 400, burst: 600,
			steps:  repeat(step{calls: callsAlway, events: []string{"Pulling", "Pulled"}}, 3),
			metric: [3]string{"always", "unknown", "true"}},
		{name: "image present and excessive qps rate, pull", image: "present_image", policy: events.PullAlways, qps: 2000, burst: 0,
			steps: []step{
				{calls: nil, err: ErrImagePull, events: []string{"Pulling", "Failed"}, msg: "pull QPS exceeded"},
				{calls: nil, err: ErrImagePull, events: []string{"Pulling", "Failed"}, msg: "pull QPS exceeded"},
				{calls: nil, err: ErrImagePullBackOff, events: []string{"BackOff"}, msg: `Back-off pulling image "present_image": ErrImagePull: pull QPS exceeded`},
			},
			metric: [3]string{"always", "unknown", "true"}},
		{name: "invalid image name, no pull", image: "FAILED_IMAGE", policy: events.PullAlways,
			steps: []step{{calls: nil, err: ErrInvalidImageName, events: []string{"InspectFailed"},
				msg: `Failed to apply default image tag "FAILED_IMAGE": couldn't parse image name "FAILED_IMAGE"`}},
			metric: [3]string{"always", "unknown", "unknown"}},
		{name: "invalid image name with http, no pull", image: "http://url", policy: events.PullAlways,
			steps:  []step{{calls: nil, err: ErrInvalidImageName, events: []string{"InspectFailed"}}},
			metric: [3]string{"always", "unknown", "unknown"}},
		{name: "invalid image name with sha256, no pull", image: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", policy: events.PullAlways,
			steps:  []step{{calls: nil, err: ErrInvalidImageName, events: []string{"InspectFailed"}}},
			metric: [3]string{"always", "unknown", "unknown"}},
		{name: "image missing, SignatureValidationFailed", image: "typo_image", policy: events.PullIfNotPresent,
			pullErr: ErrSignatureValidationFailed,
			steps: []step{
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrSignatureValidationFailed, events: []string{"Pulling", "Failed"},
					msg: "image pull failed for typo_image because the signature validation failed"},
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrSignatureValidationFailed, events: []string{"Pulling", "Failed"},
					msg: "image pull failed for typo_image because the signature validation failed"},
				{calls: callsRef, err: ErrImagePullBackOff, events: []string{"BackOff"},
					msg: `Back-off pulling image "typo_image": SignatureValidationFailed: image pull failed for typo_image because the signature validation failed`},
				{calls: []string{"GetImageRef", "PullImage"}, err: ErrSignatureValidationFailed, events: []string{"Pulling", "Failed"},
					msg: "image pull failed for typo_image because the signature validation failed"},
				{calls: callsRef, err: ErrImagePullBackOff, events: []string{"BackOff"},
					msg: `Back-off pulling image "typo_image": SignatureValidationFailed: image pull failed for typo_image because the signature validation failed`},
			},
			metric: [3]string{"ifnotpresent", "false", "true"}},
	}
}

func secretCred(ns, name, uid, hash string) Credential {
	return Credential{Secret: &SecretSource{Namespace: ns, Name: name, UID: uid}, Hash: hash}
}

func saCred(ns, name, uid string) Credential {
	return Credential{ServiceAccount: &ServiceAccountSource{Namespace: ns, Name: name, UID: uid}, Hash: "sa-" + uid}
}

func seedRecord(ref, image string, pc PullCredentials) func(*memRecords) {
	return func(r *memRecords) {
		_ = r.PutRecord(context.Background(), PulledRecord{ImageRef: ref, CredentialMapping: map[string]PullCredentials{image: pc}})
	}
}

// ensureSecretImagesTestCases are the kubelet's KEP-2535 cases (E1..E8) against real pull records. The
// kubelet's test uses a static mock of the pull manager, so its later steps repeat the first; with real
// records, a pull with the pod's secret records that secret, and the following steps find the image
// accessible (no pull). The first step of every case is the kubelet's expectation exactly.
func ensureSecretImagesTestCases() []pullCase {
	pulled := step{calls: callsPull, events: []string{"Pulling", "Pulled"}}
	present := step{calls: callsRef, events: []string{"Pulled"}, msg: "already present on machine and can be accessed by the pod"}
	return []pullCase{
		{name: "image present, unknown to image pull manager, pull", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{secretCred("testns", "testname", "testuid", "h-pod")},
			seed:  seedRecord("present_image:latest", "another_image", PullCredentials{KubernetesSecrets: []RecordSecret{{UID: "testuid", Namespace: "testns", Name: "testname", CredentialHash: "h-other"}}}),
			steps: []step{pulled, present, present}, metric: [3]string{"ifnotpresent", "true", "true"}},
		{name: "image present, unknown secret to image pull manager, pull", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{secretCred("testns", "testname", "someothertestuid", "h-pod")},
			seed:  seedRecord("present_image:latest", "present_image", PullCredentials{KubernetesSecrets: []RecordSecret{{UID: "testuid", Namespace: "testns", Name: "testname", CredentialHash: "h-other"}}}),
			steps: []step{pulled, present, present}, metric: [3]string{"ifnotpresent", "true", "true"}},
		{name: "image present, unknown secret to image pull manager, never pull policy -> fail", image: "present_image", policy: events.PullNever,
			creds: staticCreds{secretCred("testns", "testname", "someothertestuid", "h-pod")},
			seed:  seedRecord("present_image:latest", "present_image", PullCredentials{KubernetesSecrets: []RecordSecret{{UID: "testuid", Namespace: "testns", Name: "testname", CredentialHash: "h-other"}}}),
			steps: repeat(step{calls: callsRef, err: ErrImageNeverPull, events: []string{"ErrImageNeverPull"},
				msg: `Container image "present_image" is not present with pull policy of Never`}, 3),
			metric: [3]string{"never", "true", "true"}},
		{name: "image present, a secret matches one of known to the image pull manager, don't pull", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{secretCred("testns", "testname", "someothertestuid", "h-pod1"), secretCred("testns", "testname", "testuid", "h-pod2")},
			seed:  seedRecord("present_image:latest", "present_image", PullCredentials{KubernetesSecrets: []RecordSecret{{UID: "testuid", Namespace: "testns", Name: "testname", CredentialHash: "h-other"}}}),
			steps: repeat(present, 3), metric: [3]string{"ifnotpresent", "true", "false"}},
		{name: "image present, service account credentials available, don't pull", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{saCred("test-ns", "test-service-account", "sa-uid-123")},
			steps: []step{present}, metric: [3]string{"ifnotpresent", "true", "false"}},
		{name: "image present, service account allowed by pull manager, don't pull", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{saCred("test-ns", "test-service-account", "sa-uid-123")},
			seed: seedRecord("present_image:latest", "present_image", PullCredentials{KubernetesServiceAccounts: []RecordServiceAccount{
				{UID: "sa-uid-123", Namespace: "test-ns", Name: "test-service-account"}}}),
			steps: []step{present}, metric: [3]string{"ifnotpresent", "true", "false"}},
		{name: "image present, mixed credentials (secrets + service accounts), pull required", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{secretCred("test-ns", "test-secret", "secret-uid", "h-pod"), saCred("test-ns", "test-service-account", "sa-uid-456")},
			seed: seedRecord("present_image:latest", "present_image", PullCredentials{KubernetesSecrets: []RecordSecret{
				{UID: "different-secret-uid", Namespace: "test-ns", Name: "test-secret", CredentialHash: "h-other"}}}),
			steps: []step{pulled}, metric: [3]string{"ifnotpresent", "true", "true"}},
		{name: "image present, only node credentials (no source), proceed without tracking", image: "present_image", policy: events.PullIfNotPresent,
			creds: staticCreds{{Hash: "node"}},
			steps: []step{present}, metric: [3]string{"ifnotpresent", "true", "false"}},
	}
}

func runPullCase(t *testing.T, c pullCase, o harnessOpts) {
	t.Helper()
	o.qps, o.burst, o.creds = c.qps, c.burst, c.creds
	h := newHarness(o)
	h.rt.err, h.rt.inspectErr = c.pullErr, c.inspectErr
	if c.seed != nil {
		c.seed(h.recs)
	}
	pod := events.PodRef{Namespace: "test-ns", Name: "test_pod", UID: "bar"}
	for i, s := range c.steps {
		h.rt.resetCalls()
		h.clock.Step(time.Second)
		out := h.m.EnsureImageExists(t.Context(), Request{Image: c.image, Policy: c.policy, Pod: pod})
		calls := h.rt.resetCalls()
		if fmtCalls(calls) != fmtCalls(s.calls) && !(len(calls) == 0 && len(s.calls) == 0) {
			t.Errorf("step %d: calls %v, want %v", i+1, calls, s.calls)
		}
		if s.err == nil && out.Err != nil || s.err != nil && !errors.Is(out.Err, s.err) {
			t.Errorf("step %d: err %v, want %v (message %q)", i+1, out.Err, s.err, out.Message)
		}
		if got := reasons(out.Events); strings.Join(got, ",") != strings.Join(s.events, ",") {
			t.Errorf("step %d: events %v, want %v", i+1, got, s.events)
		}
		if !strings.Contains(out.Message, s.msg) {
			t.Errorf("step %d: message %q does not contain %q", i+1, out.Message, s.msg)
		}
		if i == 0 {
			// Every label combination is exported at 0 from the start: the step's request is the only 1.
			if got := testutil.ToFloat64(h.m.metrics.ensureRequests.WithLabelValues(c.metric[0], c.metric[1], c.metric[2])); got != 1 {
				t.Errorf("step 1 metric: kubelet_image_manager_ensure_image_requests_total{pull_policy=%q,present_locally=%q,pull_required=%q} = %v, want 1",
					c.metric[0], c.metric[1], c.metric[2], got)
			}
			var sum float64
			for _, policy := range []string{"always", "ifnotpresent", "never"} {
				for _, present := range []string{"true", "false", "unknown"} {
					for _, required := range []string{"true", "false", "unknown"} {
						sum += testutil.ToFloat64(h.m.metrics.ensureRequests.WithLabelValues(policy, present, required))
					}
				}
			}
			if n := testutil.CollectAndCount(h.m.metrics.ensureRequests); sum != 1 || n != 27 {
				t.Errorf("step 1 metric: %v requests counted over %d series, want 1 over 27", sum, n)
			}
		}
	}
}

// TestParallelPuller, TestSerializedPuller and TestImagePullPrecheck of the kubelet: every case in the
// serial and the unlimited parallel puller, with KEP-2535 on (the v1.36 default) and off.
func TestPullerCases(t *testing.T) {
	modes := []struct {
		name string
		o    harnessOpts
	}{
		{"serialized", harnessOpts{serial: true}},
		{"parallel", harnessOpts{}},
		{"parallel-max-3", harnessOpts{maxParallel: 3}},
	}
	for _, mode := range modes {
		for _, c := range noFGPullerTestCases() {
			t.Run(mode.name+"/"+c.name, func(t *testing.T) { runPullCase(t, c, mode.o) })
			t.Run(mode.name+"/[KubeletEnsureSecretPulledImages off] "+c.name, func(t *testing.T) {
				o := mode.o
				o.gateOff = true
				runPullCase(t, c, o)
			})
		}
		for _, c := range ensureSecretImagesTestCases() {
			t.Run(mode.name+"/[KubeletEnsureSecretPulledImages] "+c.name, func(t *testing.T) { runPullCase(t, c, mode.o) })
		}
	}
}

func TestPulledMessages(t *testing.T) {
	for _, gateOff := range []bool{false, true} {
		h := newHarness(harnessOpts{serial: true, gateOff: gateOff})
		out := h.m.EnsureImageExists(t.Context(), Request{Image: "present_image", Policy: events.PullIfNotPresent})
		want := `Container image "present_image" already present on machine and can be accessed by the pod`
		if gateOff {
			want = `Container image "present_image" already present on machine`
		}
		if len(out.Events) != 1 || out.Events[0].Message != want || out.Events[0].Severity != events.Normal {
			t.Errorf("gate off %v: events %+v, want Normal %q", gateOff, out.Events, want)
		}
		out = h.m.EnsureImageExists(t.Context(), Request{Image: "missing_image", Policy: events.PullIfNotPresent})
		if len(out.Events) != 2 || out.Events[0].Message != `Pulling image "missing_image"` ||
			!strings.HasPrefix(out.Events[1].Message, `Successfully pulled image "missing_image" in `) ||
			!strings.Contains(out.Events[1].Message, " including waiting). Image size: 1048576 bytes.") {
			t.Errorf("pull events %+v", out.Events)
		}
	}
	h := newHarness(harnessOpts{serial: true})
	h.rt.err = errors.New("RegistryUnavailable: dial tcp: connection refused")
	out := h.m.EnsureImageExists(t.Context(), Request{Image: "typo_image", Policy: events.PullIfNotPresent, Pod: events.PodRef{UID: "u"}})
	if !errors.Is(out.Err, ErrRegistryUnavailable) || out.Message != "image pull failed for typo_image because the registry is unavailable: dial tcp: connection refused" {
		t.Errorf("registry unavailable: %v %q", out.Err, out.Message)
	}
	if ev := out.Events[1]; ev.Severity != events.Warning || ev.Message != `Failed to pull image "typo_image": RegistryUnavailable: dial tcp: connection refused` {
		t.Errorf("failed event %+v", ev)
	}
	h.clock.Step(time.Second / 2)
	out = h.m.EnsureImageExists(t.Context(), Request{Image: "typo_image", Policy: events.PullIfNotPresent, Pod: events.PodRef{UID: "u"}})
	if ev := out.Events[0]; ev.Severity != events.Normal || ev.Reason != "BackOff" || ev.Message != `Back-off pulling image "typo_image"` {
		t.Errorf("backoff event %+v", ev)
	}
	// Another pod does not share the first pod's backoff.
	out = h.m.EnsureImageExists(t.Context(), Request{Image: "typo_image", Policy: events.PullIfNotPresent, Pod: events.PodRef{UID: "other"}})
	if !errors.Is(out.Err, ErrRegistryUnavailable) {
		t.Errorf("other pod: %v, want its own pull", out.Err)
	}
}

func TestApplyDefaultImageTag(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"root", "root:latest"},
		{"root:tag", "root:tag"},
		{"root@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "root@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
		{"root:latest@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "root:latest@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
		{"root:latest", "root:latest"},
		{"localhost:5000/root", "localhost:5000/root:latest"},
	} {
		t.Run(c.in, func(t *testing.T) {
			got, err := applyDefaultImageTag(c.in)
			if err != nil || got != c.want {
				t.Errorf("applyDefaultImageTag(%q) = %q, %v; want %q", c.in, got, err, c.want)
			}
		})
	}
}

func TestEvalCRIPullErr(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		kind error
		msg  string
	}{
		{"fallback error", errors.New("test"), ErrImagePull, "test"},
		{"registry unavailable", ErrRegistryUnavailable, ErrRegistryUnavailable, "image pull failed for test because the registry is unavailable"},
		{"registry unavailable with additional error message", fmt.Errorf("%w: foo", ErrRegistryUnavailable), ErrRegistryUnavailable, "image pull failed for test because the registry is unavailable: foo"},
		{"signature is invalid", ErrSignatureValidationFailed, ErrSignatureValidationFailed, "image pull failed for test because the signature validation failed"},
		{"signature is invalid with additional error message (wrapped)", fmt.Errorf("%w: bar", ErrSignatureValidationFailed), ErrSignatureValidationFailed, "image pull failed for test because the signature validation failed: bar"},
	} {
		t.Run(c.name, func(t *testing.T) {
			msg, kind := evalCRIPullErr("test", c.err)
			if kind != c.kind || msg != c.msg {
				t.Errorf("evalCRIPullErr = (%q, %v), want (%q, %v)", msg, kind, c.msg, c.kind)
			}
		})
	}
}

func TestDefaultPullPolicy(t *testing.T) {
	for in, want := range map[string]string{
		"busybox": events.PullAlways, "busybox:latest": events.PullAlways, "busybox:1.36": events.PullIfNotPresent,
		"busybox@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855":        events.PullIfNotPresent,
		"busybox:latest@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855": events.PullAlways,
	} {
		if got := defaultPullPolicy(in); got != want {
			t.Errorf("defaultPullPolicy(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestMaxParallelImagePullsLimit is the kubelet's test with one difference: its seven calls pull one image,
// which imagefleet's single-flight would make one pull, so here each call pulls its own image.
func TestMaxParallelImagePullsLimit(t *testing.T) {
	synctest.Test(t, testMaxParallelImagePullsLimit)
}

// testMaxParallelImagePullsLimit runs in a synctest bubble: synctest.Wait returns when every call is blocked
// (in the runtime or at a token), so the count it then reads is final, not a guess after a sleep.
func testMaxParallelImagePullsLimit(t *testing.T) {
	const maxParallel = 5
	h := newHarness(harnessOpts{maxParallel: maxParallel})
	h.rt.block = true
	var wg sync.WaitGroup
	errs := make(chan error, 7)
	start := func(from, to int) {
		for i := from; i < to; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				out := h.m.EnsureImageExists(t.Context(), Request{Image: fmt.Sprintf("present_image_%d", i), Policy: events.PullAlways,
					Pod: events.PodRef{Namespace: "test-ns", Name: "test_pod", UID: "bar"}})
				errs <- out.Err
			}()
		}
	}
	waitPulls := func(want int64) {
		t.Helper()
		synctest.Wait()
		if got := h.rt.pulls.Load(); got != want {
			t.Fatalf("PullImage calls %d, want %d", got, want)
		}
	}
	start(0, maxParallel)
	waitPulls(5)
	start(maxParallel, maxParallel+2)
	// The two extra calls stay at the token: every goroutine is blocked before the count is read.
	synctest.Wait()
	if got := h.rt.pulls.Load(); got != 5 {
		t.Fatalf("PullImage calls %d after 7 requests with 5 tokens, want 5", got)
	}
	h.rt.release <- nil
	h.rt.release <- nil
	waitPulls(7)
	for range 5 {
		h.rt.release <- nil
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("pull: %v", err)
		}
	}
	if got := h.rt.maxInFlight.Load(); got > maxParallel {
		t.Errorf("max in flight %d > %d", got, maxParallel)
	}
}

// TestSingleFlight: concurrent requests for one image with the same credentials make one runtime pull;
// a request with other credentials does not join it.
func TestSingleFlight(t *testing.T) { synctest.Test(t, testSingleFlight) }

func testSingleFlight(t *testing.T) {
	h := newHarness(harnessOpts{})
	h.rt.block = true
	var wg sync.WaitGroup
	outs := make([]Outcome, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i] = h.m.EnsureImageExists(t.Context(), Request{Image: "missing_image", Policy: events.PullIfNotPresent,
				Pod: events.PodRef{Namespace: "ns", Name: fmt.Sprintf("p%d", i), UID: fmt.Sprintf("uid-%d", i)}})
		}()
	}
	// One pull is in the runtime and the other three wait on its flight once every goroutine is blocked.
	synctest.Wait()
	if got := h.rt.pulls.Load(); got != 1 {
		t.Fatalf("runtime pulls %d while the requests wait, want 1", got)
	}
	h.rt.release <- nil
	wg.Wait()
	if got := h.rt.pulls.Load(); got != 1 {
		t.Fatalf("runtime pulls %d, want 1", got)
	}
	shared := 0
	for i, o := range outs {
		if o.Err != nil || o.ImageRef != "missing_image:latest" {
			t.Errorf("request %d: %v %q", i, o.Err, o.ImageRef)
		}
		if o.Shared {
			shared++
		}
	}
	if shared != 3 {
		t.Errorf("%d requests shared the pull, want 3", shared)
	}
}

// TestCancelLastWaiterCancelsPull: a pull whose only requester goes away is cancelled in the runtime;
// one still wanted by another requester goes on (kubernetes/kubernetes#88662).
func TestCancelLastWaiterCancelsPull(t *testing.T) { synctest.Test(t, testCancelLastWaiterCancelsPull) }

func testCancelLastWaiterCancelsPull(t *testing.T) {
	h := newHarness(harnessOpts{})
	h.rt.block = true
	ctx1, cancel1 := context.WithCancelCause(t.Context())
	ctx2, cancel2 := context.WithCancelCause(t.Context())
	res := make(chan Outcome, 2)
	go func() {
		res <- h.m.EnsureImageExists(ctx1, Request{Image: "missing_image", Policy: events.PullAlways, Pod: events.PodRef{UID: "a"}})
	}()
	synctest.Wait() // the pull is in the runtime
	if h.rt.inFlight.Load() != 1 {
		t.Fatalf("runtime pulls in flight %d, want 1", h.rt.inFlight.Load())
	}
	go func() {
		res <- h.m.EnsureImageExists(ctx2, Request{Image: "missing_image", Policy: events.PullAlways, Pod: events.PodRef{UID: "b"}})
	}()
	synctest.Wait() // pod b waits on the same flight
	cancel1(errPodDeleted)
	o := <-res
	if !o.Cancelled || !errors.Is(o.Err, ErrImagePull) || !strings.Contains(o.Message, "pod deleted") {
		t.Fatalf("cancelled request: %+v", o)
	}
	if h.rt.inFlight.Load() != 1 {
		t.Fatalf("the pull stopped although pod b still waits")
	}
	cancel2(errPodDeleted)
	<-res
	synctest.Wait()
	if h.rt.inFlight.Load() != 0 {
		t.Fatal("runtime pull not cancelled after its last requester left")
	}
	h.m.wait()
	// A cancellation is not a registry failure: no backoff for pod a.
	h.rt.block = false
	o = h.m.EnsureImageExists(t.Context(), Request{Image: "missing_image", Policy: events.PullAlways, Pod: events.PodRef{UID: "a"}})
	if o.Err != nil {
		t.Fatalf("after cancellation: %v", o.Err)
	}
}
