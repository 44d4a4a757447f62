package hollow_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// dial serves r in-process and returns a CRI client on it, closed when the test ends.
func dial(t testing.TB, r *hollow.Runtime) *cri.Client {
	t.Helper()
	c, closeFn, err := r.Dial(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeFn)
	return c
}

// rawClients starts r on a unix socket and returns the generated CRI clients, for calls cri.Client does
// not make (filters, streams).
func rawClients(t *testing.T, r *hollow.Runtime) (runtimeapi.RuntimeServiceClient, runtimeapi.ImageServiceClient) {
	t.Helper()
	ep, stop, err := r.StartUnix(t.Context(), filepath.Join(t.TempDir(), "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	conn, err := grpc.NewClient(ep, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return runtimeapi.NewRuntimeServiceClient(conn), runtimeapi.NewImageServiceClient(conn)
}

func mustAdd(t testing.TB, r *hollow.Runtime, img cri.Image) cri.Image {
	t.Helper()
	got, err := r.AddImage(img)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func TestPullListStatusRemove(t *testing.T) {
	r := hollow.New(hollow.Options{Name: "node-a", DefaultImageSize: func(string) int64 { return 100 }})
	c := dial(t, r)
	ctx := t.Context()

	id, err := c.PullImage(ctx, "nginx", nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(id, "sha256:") || len(id) != len("sha256:")+64 {
		t.Fatalf("image ref %q, want sha256:<64 hex>", id)
	}
	again, err := c.PullImage(ctx, "docker.io/library/nginx:latest", nil, nil, nil)
	if err != nil || again != id {
		t.Fatalf("second pull = %q, %v; want %q (idempotent)", again, err, id)
	}
	imgs, err := c.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgs) != 1 {
		t.Fatalf("ListImages = %d images, want 1: %+v", len(imgs), imgs)
	}
	im := imgs[0]
	if im.ID != id || !slices.Equal(im.RepoTags, []string{"docker.io/library/nginx:latest"}) || im.Size != 100 {
		t.Fatalf("image = %+v", im)
	}
	if len(im.RepoDigests) != 1 || !strings.HasPrefix(im.RepoDigests[0], "docker.io/library/nginx@sha256:") {
		t.Fatalf("RepoDigests = %v", im.RepoDigests)
	}

	// The same reference gives the same ID on another node: IDs come from the reference.
	other := hollow.New(hollow.Options{Name: "node-b"})
	if oid, err := dial(t, other).PullImage(ctx, "nginx:latest", nil, nil, nil); err != nil || oid != id {
		t.Fatalf("pull on another node = %q, %v; want %q", oid, err, id)
	}

	for _, tc := range []struct{ name, ref string }{
		{"id", id},
		{"id without algorithm", strings.TrimPrefix(id, "sha256:")},
		{"familiar name", "nginx"},
		{"familiar tag", "nginx:latest"},
		{"normalized tag", "docker.io/library/nginx:latest"},
		{"repo digest", im.RepoDigests[0]},
	} {
		t.Run("status/"+tc.name, func(t *testing.T) {
			got, err := c.ImageStatus(ctx, tc.ref)
			if err != nil || got.ID != id {
				t.Fatalf("ImageStatus(%q) = %+v, %v; want %s", tc.ref, got, err, id)
			}
		})
	}
	for _, ref := range []string{"nginx:1.25", "busybox", "sha256:" + strings.Repeat("0", 64), "Invalid//Ref"} {
		if _, err := c.ImageStatus(ctx, ref); !errors.Is(err, cri.ErrNotFound) {
			t.Errorf("ImageStatus(%q) err = %v, want ErrNotFound", ref, err)
		}
	}

	fs, err := c.ImageFsInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(fs) != 1 || fs[0].Mountpoint != "/hollow/node-a/images" || fs[0].UsedBytes != 100 || time.Since(fs[0].Timestamp) > time.Minute {
		t.Fatalf("ImageFsInfo = %+v", fs)
	}

	if err := c.RemoveImage(ctx, "nginx"); err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveImage(ctx, id); err != nil {
		t.Fatalf("removing a missing image = %v, want success (as containerd)", err)
	}
	if imgs, _ := c.ListImages(ctx); len(imgs) != 0 {
		t.Fatalf("after remove ListImages = %+v", imgs)
	}
	if fs, _ := c.ImageFsInfo(ctx); fs[0].UsedBytes != 0 {
		t.Fatalf("after remove used bytes = %d", fs[0].UsedBytes)
	}
	if got := r.Removes(); got != 2 {
		t.Errorf("Removes() = %d, want 2", got)
	}
	if got := r.Pulls(); got != 2 {
		t.Errorf("Pulls() = %d, want 2", got)
	}
	want := []string{"PullImage", "PullImage", "ListImages"}
	if got := r.Calls(); !slices.Equal(got[:3], want) {
		t.Errorf("Calls() starts %v, want %v", got[:3], want)
	}
	r.ResetCalls()
	if got := r.Calls(); len(got) != 0 {
		t.Errorf("after ResetCalls, Calls() = %v", got)
	}
}

func TestPullByDigest(t *testing.T) {
	r := hollow.New(hollow.Options{})
	c := dial(t, r)
	dgst := "sha256:" + strings.Repeat("ab", 32)
	for _, ref := range []string{"busybox@" + dgst, "busybox:1.36@" + dgst} { // the tag is dropped, as containerd does
		id, err := c.PullImage(t.Context(), ref, nil, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		im, err := c.ImageStatus(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if len(im.RepoTags) != 0 || !slices.Equal(im.RepoDigests, []string{"docker.io/library/busybox@" + dgst}) {
			t.Fatalf("pulled %s: %+v", ref, im)
		}
	}
	if n := len(r.Images()); n != 1 {
		t.Fatalf("%d images, want 1", n)
	}
}

func TestDefaultImageSize(t *testing.T) {
	r := hollow.New(hollow.Options{})
	c := dial(t, r)
	sizes := map[int64]bool{}
	for i := range 20 {
		ref := fmt.Sprintf("example.com/app%d:v1", i)
		if _, err := c.PullImage(t.Context(), ref, nil, nil, nil); err != nil {
			t.Fatal(err)
		}
		im, _ := r.Image(ref)
		if im.Size < 5<<20 || im.Size > 300<<20 {
			t.Errorf("%s: size %d outside 5-300 MiB", ref, im.Size)
		}
		again, _ := hollow.New(hollow.Options{}).AddImage(cri.Image{RepoTags: []string{ref}})
		if again.Size != im.Size || again.ID != im.ID {
			t.Errorf("%s: another node has %d %s, want %d %s", ref, again.Size, again.ID, im.Size, im.ID)
		}
		sizes[im.Size] = true
	}
	if len(sizes) < 15 {
		t.Errorf("only %d distinct sizes over 20 refs", len(sizes))
	}
	if err := r.SetImageSize("example.com/app0:v1", 42); err != nil {
		t.Fatal(err)
	}
	if im, _ := c.ImageStatus(t.Context(), "example.com/app0:v1"); im.Size != 42 {
		t.Fatalf("after SetImageSize, size = %d", im.Size)
	}
	if err := r.SetImageSize("missing", 1); !errors.Is(err, cri.ErrNotFound) {
		t.Fatalf("SetImageSize(missing) = %v, want ErrNotFound", err)
	}
}

func TestPinned(t *testing.T) {
	r := hollow.New(hollow.Options{PinnedRefs: []string{"registry.k8s.io/pause:3.10"}})
	c := dial(t, r)
	if _, err := c.PullImage(t.Context(), "registry.k8s.io/pause:3.10", nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PullImage(t.Context(), "nginx", nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	mustAdd(t, r, cri.Image{ID: "sha256:" + strings.Repeat("1", 64), RepoTags: []string{"app:v1"}, Size: 7, Pinned: true})
	imgs, err := c.ListImages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	pinned := map[string]bool{}
	for _, im := range imgs {
		pinned[im.RepoTags[0]] = im.Pinned
	}
	want := map[string]bool{"registry.k8s.io/pause:3.10": true, "docker.io/library/nginx:latest": false, "docker.io/library/app:v1": true}
	if fmt.Sprint(pinned) != fmt.Sprint(want) {
		t.Fatalf("pinned = %v, want %v", pinned, want)
	}
}

func TestAddImageMovesTag(t *testing.T) {
	r := hollow.New(hollow.Options{})
	a := mustAdd(t, r, cri.Image{ID: "sha256:" + strings.Repeat("a", 64), RepoTags: []string{"app:v1", "app:latest"}, Size: 1})
	b := mustAdd(t, r, cri.Image{ID: "sha256:" + strings.Repeat("b", 64), RepoTags: []string{"app:latest"}, Size: 2})
	if got, _ := r.Image("app"); got.ID != b.ID {
		t.Fatalf("app:latest resolves to %s, want %s", got.ID, b.ID)
	}
	if got, _ := r.Image(a.ID); !slices.Equal(got.RepoTags, []string{"docker.io/library/app:v1"}) {
		t.Fatalf("old image keeps tags %v, want only app:v1", got.RepoTags)
	}
	if _, err := r.AddImage(cri.Image{}); err == nil {
		t.Fatal("AddImage with neither ID nor tag succeeded")
	}
	if _, err := r.AddImage(cri.Image{RepoTags: []string{"not a ref"}}); err == nil {
		t.Fatal("AddImage with an invalid tag succeeded")
	}
}

func TestContainerReportsImageID(t *testing.T) {
	r := hollow.New(hollow.Options{})
	c := dial(t, r)
	ctx := t.Context()
	id, err := c.PullImage(ctx, "nginx:1.25", nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	sb := cri.SandboxConfig{Name: "web", Namespace: "default", UID: "uid-1"}
	sbID, err := c.RunPodSandbox(ctx, sb)
	if err != nil {
		t.Fatal(err)
	}
	ctrID, err := c.CreateContainer(ctx, sbID, sb, "nginx", "nginx:1.25", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateContainer(ctx, sbID, sb, "gone", "busybox", nil); !errors.Is(err, cri.ErrNotFound) ||
		!strings.Contains(cri.RuntimeMessage(err), "failed to get image") {
		t.Fatalf("CreateContainer of a missing image = %v, want ErrNotFound", err)
	}
	if _, err := c.CreateContainer(ctx, "no-such-sandbox", sb, "x", "nginx:1.25", nil); !errors.Is(err, cri.ErrNotFound) {
		t.Fatalf("CreateContainer in a missing sandbox = %v, want ErrNotFound", err)
	}
	if err := c.StartContainer(ctx, ctrID); err != nil {
		t.Fatal(err)
	}
	if err := c.StartContainer(ctx, ctrID); err == nil {
		t.Fatal("starting a running container succeeded")
	}
	exited, err := r.AddContainer(cri.Container{Name: "job", Image: "nginx:1.25", State: cri.ContainerExited})
	if err != nil {
		t.Fatal(err)
	}
	orphanImage := "sha256:" + strings.Repeat("9", 64)
	orphan, err := r.AddContainer(cri.Container{Name: "old", ImageID: orphanImage, State: cri.ContainerExited})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddContainer(cri.Container{Name: "bad", Image: "busybox"}); !errors.Is(err, cri.ErrNotFound) {
		t.Fatalf("AddContainer of a missing image = %v, want ErrNotFound", err)
	}

	list, err := c.ListContainers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]cri.Container{}
	for _, ct := range list {
		got[ct.ID] = ct
	}
	if len(got) != 3 {
		t.Fatalf("ListContainers = %+v, want 3", list)
	}
	if ct := got[ctrID]; ct.ImageID != id || ct.Image != "nginx:1.25" || ct.State != cri.ContainerRunning ||
		ct.PodSandboxID != sbID || ct.Name != "nginx" {
		t.Fatalf("created container = %+v, want image ID %s, running", ct, id)
	}
	if ct := got[exited]; ct.ImageID != id || ct.State != cri.ContainerExited {
		t.Fatalf("added container = %+v, want image ID %s, exited", ct, id)
	}
	if ct := got[orphan]; ct.ImageID != orphanImage {
		t.Fatalf("orphan container = %+v", ct)
	}

	// Stopping the sandbox exits its containers; removing it removes them.
	if err := c.StopPodSandbox(ctx, sbID); err != nil {
		t.Fatal(err)
	}
	if cs := r.Containers(); cs[slices.IndexFunc(cs, func(c cri.Container) bool { return c.ID == ctrID })].State != cri.ContainerExited {
		t.Fatalf("after StopPodSandbox: %+v", cs)
	}
	if err := c.RemovePodSandbox(ctx, sbID); err != nil {
		t.Fatal(err)
	}
	if err := c.RemovePodSandbox(ctx, sbID); err != nil {
		t.Fatalf("removing a removed sandbox = %v, want success", err)
	}
	if err := c.StopPodSandbox(ctx, sbID); !errors.Is(err, cri.ErrNotFound) {
		t.Fatalf("stopping a removed sandbox = %v, want ErrNotFound", err)
	}
	r.RemoveContainer(orphan)
	r.RemoveContainer(orphan)
	if list, _ := c.ListContainers(ctx); len(list) != 1 || list[0].ID != exited {
		t.Fatalf("after removals ListContainers = %+v, want only %s", list, exited)
	}
	if err := r.SetContainerState(exited, cri.ContainerRunning); err != nil {
		t.Fatal(err)
	}
	if list, _ := c.ListContainers(ctx); list[0].State != cri.ContainerRunning {
		t.Fatalf("after SetContainerState: %+v", list)
	}
}

func TestRuntimeServiceRaw(t *testing.T) {
	r := hollow.New(hollow.Options{})
	rt, img := rawClients(t, r)
	ctx := t.Context()

	v, err := rt.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if v.RuntimeName != "hollow" || v.RuntimeVersion != "0.1.0" || v.RuntimeApiVersion != "v1" {
		t.Fatalf("Version = %+v", v)
	}
	st, err := rt.Status(ctx, &runtimeapi.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cond := range st.Status.Conditions {
		if !cond.Status {
			t.Errorf("condition %s not ready", cond.Type)
		}
	}
	if len(st.Status.Conditions) != 2 {
		t.Errorf("conditions = %v", st.Status.Conditions)
	}

	for i := range 2500 {
		mustAdd(t, r, cri.Image{RepoTags: []string{fmt.Sprintf("example.com/img%04d:v1", i)}, Size: 1})
	}
	f, err := img.ListImages(ctx, &runtimeapi.ListImagesRequest{Filter: &runtimeapi.ImageFilter{Image: &runtimeapi.ImageSpec{Image: "example.com/img0042:v1"}}})
	if err != nil || len(f.Images) != 1 || f.Images[0].RepoTags[0] != "example.com/img0042:v1" {
		t.Fatalf("filtered ListImages = %v, %v", f, err)
	}
	stream, err := img.StreamImages(ctx, &runtimeapi.StreamImagesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var msgs, total int
	for {
		m, err := stream.Recv()
		if err != nil {
			break
		}
		msgs++
		total += len(m.Images)
	}
	if msgs != 3 || total != 2500 {
		t.Fatalf("StreamImages: %d messages, %d images; want 3, 2500", msgs, total)
	}

	sb, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "ns", Uid: "u"}, Labels: map[string]string{"app": "x"}}})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := range 3 {
		cr, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: sb.PodSandboxId, Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: fmt.Sprint("c", i)}, Image: &runtimeapi.ImageSpec{Image: "example.com/img0001:v1"},
			Labels: map[string]string{"i": fmt.Sprint(i)}}})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, cr.ContainerId)
	}
	if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: ids[0]}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		filter *runtimeapi.ContainerFilter
		want   int
	}{
		{"all", nil, 3},
		{"running", &runtimeapi.ContainerFilter{State: &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING}}, 1},
		{"created", &runtimeapi.ContainerFilter{State: &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_CREATED}}, 2},
		{"sandbox", &runtimeapi.ContainerFilter{PodSandboxId: sb.PodSandboxId}, 3},
		{"other sandbox", &runtimeapi.ContainerFilter{PodSandboxId: "nope"}, 0},
		{"id", &runtimeapi.ContainerFilter{Id: ids[2]}, 1},
		{"label", &runtimeapi.ContainerFilter{LabelSelector: map[string]string{"i": "1"}}, 1},
	} {
		t.Run("containers/"+tc.name, func(t *testing.T) {
			l, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: tc.filter})
			if err != nil || len(l.Containers) != tc.want {
				t.Fatalf("ListContainers(%v) = %d, %v; want %d", tc.filter, len(l.GetContainers()), err, tc.want)
			}
		})
	}
	cs, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: ids[0]})
	if err != nil {
		t.Fatal(err)
	}
	wantID, _ := r.Image("example.com/img0001:v1")
	if cs.Status.ImageId != wantID.ID || cs.Status.ImageRef != wantID.ID || cs.Status.Image.Image != "example.com/img0001:v1" ||
		cs.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING || cs.Status.StartedAt == 0 {
		t.Fatalf("ContainerStatus = %+v", cs.Status)
	}
	if _, err := rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: ids[0]}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: ids[1]}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: ids[1]}); status.Code(err) != codes.NotFound {
		t.Fatalf("status of a removed container = %v, want NotFound", err)
	}
	ps, err := rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sb.PodSandboxId})
	if err != nil || ps.Status.State != runtimeapi.PodSandboxState_SANDBOX_READY || ps.Status.Metadata.Uid != "u" {
		t.Fatalf("PodSandboxStatus = %v, %v", ps, err)
	}
	l, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"app": "x"}}})
	if err != nil || len(l.Items) != 1 {
		t.Fatalf("ListPodSandbox = %v, %v", l, err)
	}
	if _, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: ids[0]}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("ExecSync = %v, want Unimplemented", err)
	}
}

func TestRequireAuth(t *testing.T) {
	r := hollow.New(hollow.Options{})
	r.RequireAuth("127.0.0.1:5000", "alice", "s3cret")
	c := dial(t, r)
	const ref = "127.0.0.1:5000/private/app:v2"
	for _, tc := range []struct {
		name string
		auth *cri.AuthConfig
		ok   bool
	}{
		{"none", nil, false},
		{"wrong password", &cri.AuthConfig{Username: "alice", Password: "nope"}, false},
		{"user and password", &cri.AuthConfig{Username: "alice", Password: "s3cret"}, true},
		{"auth field", &cri.AuthConfig{Auth: base64.StdEncoding.EncodeToString([]byte("alice:s3cret"))}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.PullImage(t.Context(), ref, tc.auth, nil, nil)
			if tc.ok {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			want := `failed to pull and unpack image "127.0.0.1:5000/private/app:v2": failed to resolve reference "127.0.0.1:5000/private/app:v2": ` +
				"unexpected status from HEAD request to http://127.0.0.1:5000/v2/private/app/manifests/v2: 401 Unauthorized"
			if err == nil || cri.RuntimeMessage(err) != want || errors.Is(err, cri.ErrNotFound) {
				t.Fatalf("pull = %v\nwant message %s", err, want)
			}
		})
	}
	if _, err := c.PullImage(t.Context(), "nginx", nil, nil, nil); err != nil {
		t.Fatalf("pull from a registry without auth: %v", err)
	}
	r.RequireAuth("127.0.0.1:5000", "", "")
	if _, err := c.PullImage(t.Context(), "127.0.0.1:5000/other:v1", nil, nil, nil); err != nil {
		t.Fatalf("pull after the requirement was removed: %v", err)
	}
}

func TestFailPulls(t *testing.T) {
	r := hollow.New(hollow.Options{})
	c := dial(t, r)
	r.FailPulls("nginx", status.Error(codes.Unknown, "RegistryUnavailable: dial tcp: connection refused"))
	_, err := c.PullImage(t.Context(), "docker.io/library/nginx:latest", nil, nil, nil)
	if err == nil || !strings.HasPrefix(cri.RuntimeMessage(err), cri.RegistryUnavailable) {
		t.Fatalf("pull = %v, want a RegistryUnavailable message", err)
	}
	if len(r.Images()) != 0 {
		t.Fatal("a failed pull stored an image")
	}
	r.FailPulls("nginx:latest", nil)
	if _, err := c.PullImage(t.Context(), "nginx", nil, nil, nil); err != nil {
		t.Fatalf("pull after the failure was cleared: %v", err)
	}
	if _, err := c.PullImage(t.Context(), "Not A Ref", nil, nil, nil); !errors.Is(err, cri.ErrInvalid) {
		t.Fatalf("pull of an invalid reference = %v, want ErrInvalid", err)
	}
}

func TestBlockedPulls(t *testing.T) {
	r := hollow.New(hollow.Options{})
	c := dial(t, r)
	r.BlockPulls()
	const n = 5
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			_, errs[i] = c.PullImage(t.Context(), fmt.Sprintf("example.com/app%d:v1", i), nil, nil, nil)
		})
	}
	bustest.WaitFor(t, "5 held pulls", func() bool { return r.BlockedPulls() == n })
	if got := r.InFlightPulls(); got != n {
		t.Fatalf("InFlightPulls = %d, want %d", got, n)
	}
	r.UnblockPulls(2)
	// A pull that stored its image leaves the in-flight count a moment later, when its handler returns.
	bustest.WaitFor(t, "2 pulls through", func() bool {
		return len(r.Images()) == 2 && r.BlockedPulls() == n-2 && r.InFlightPulls() == n-2
	})
	r.UnblockAllPulls()
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if r.MaxInFlightPulls() != n || r.InFlightPulls() != 0 || len(r.Images()) != n {
		t.Fatalf("max in flight %d, in flight %d, images %d", r.MaxInFlightPulls(), r.InFlightPulls(), len(r.Images()))
	}

	// A held pull whose context ends fails with the context's code and leaves the gate.
	r.BlockPulls()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.PullImage(ctx, "example.com/late:v1", nil, nil, nil); !errors.Is(err, cri.ErrTimeout) {
		t.Fatalf("held pull past its deadline = %v, want ErrTimeout", err)
	}
	bustest.WaitFor(t, "the gate to empty", func() bool { return r.BlockedPulls() == 0 && r.InFlightPulls() == 0 })
	r.UnblockAllPulls()
}

func TestPullLatencyHonorsContext(t *testing.T) {
	r := hollow.New(hollow.Options{PullLatency: time.Hour})
	c := dial(t, r)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := c.PullImage(ctx, "nginx", nil, nil, nil); !errors.Is(err, cri.ErrTimeout) {
		t.Fatalf("pull = %v, want ErrTimeout", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("pull took %v", d)
	}

	fast := hollow.New(hollow.Options{PullLatency: 20 * time.Millisecond})
	start = time.Now()
	if _, err := dial(t, fast).PullImage(t.Context(), "nginx", nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 20*time.Millisecond {
		t.Fatalf("pull took %v, less than its latency", d)
	}
}

func TestServeStopsHeldPulls(t *testing.T) {
	r := hollow.New(hollow.Options{StopTimeout: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	ep, stop, err := r.StartUnix(ctx, filepath.Join(t.TempDir(), "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	c, err := cri.Dial(cri.Config{Endpoint: ep})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r.BlockPulls()
	pullErr := make(chan error, 1)
	go func() {
		_, err := c.PullImage(t.Context(), "nginx", nil, nil, nil)
		pullErr <- err
	}()
	bustest.WaitFor(t, "a held pull", func() bool { return r.BlockedPulls() == 1 })
	cancel()
	stop() // returns only after the held pull was cancelled and its handler returned
	if err := <-pullErr; err == nil {
		t.Fatal("held pull succeeded after the server stopped")
	}
	if r.InFlightPulls() != 0 {
		t.Fatalf("InFlightPulls = %d after stop", r.InFlightPulls())
	}
	if _, err := os.Stat(strings.TrimPrefix(ep, "unix://")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind: %v", err)
	}
}

func TestServeReturnsNilAfterCancel(t *testing.T) {
	r := hollow.New(hollow.Options{})
	lis, err := hollow.ListenUnix(filepath.Join(t.TempDir(), "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, lis) }()
	c, err := cri.Dial(cri.Config{Endpoint: lis.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if name, _, err := c.Version(t.Context()); err != nil || name != "hollow" {
		t.Fatalf("Version = %q, %v", name, err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve = %v, want nil after cancel", err)
	}
}

func TestListenUnix(t *testing.T) {
	dir := t.TempDir()

	stale := filepath.Join(dir, "stale.sock")
	l, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	if _, err := os.Stat(stale); err != nil {
		t.Fatalf("no stale socket to test with: %v", err)
	}
	l, err = hollow.ListenUnix(stale)
	if err != nil {
		t.Fatalf("ListenUnix over a stale socket: %v", err)
	}
	defer l.Close()
	if _, err := hollow.ListenUnix(stale); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("ListenUnix over a live socket = %v, want in use", err)
	}

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := hollow.ListenUnix(file); err == nil {
		t.Fatal("ListenUnix over a regular file succeeded")
	}
	if _, err := hollow.ListenUnix("/tmp/" + strings.Repeat("x", 120)); err == nil {
		t.Fatal("ListenUnix with a too long path succeeded")
	}
	nested, err := hollow.ListenUnix(filepath.Join(dir, "a", "b", "c.sock"))
	if err != nil {
		t.Fatalf("ListenUnix in a new directory: %v", err)
	}
	nested.Close()
}

func TestFleet(t *testing.T) {
	const n = 100
	f, err := hollow.NewFleet(t.TempDir(), n, func(i int) hollow.Options {
		return hollow.Options{Capacity: int64(i+1) << 30}
	})
	if err != nil {
		t.Fatal(err)
	}
	stop, err := f.Start(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if f.Len() != n || len(f.Endpoints()) != n {
		t.Fatalf("Len %d, %d endpoints", f.Len(), len(f.Endpoints()))
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, ep := range f.Endpoints() {
		wg.Go(func() {
			c, err := cri.Dial(cri.Config{Endpoint: ep})
			if err != nil {
				errs[i] = err
				return
			}
			defer c.Close()
			name, version, err := c.Version(t.Context())
			if err != nil || name != "hollow" || version != "0.1.0" {
				errs[i] = fmt.Errorf("node %d: Version = %q %q, %v", i, name, version, err)
				return
			}
			if _, err := c.PullImage(t.Context(), "nginx", nil, nil, nil); err != nil {
				errs[i] = fmt.Errorf("node %d: %w", i, err)
				return
			}
			fs, err := c.ImageFsInfo(t.Context())
			if err != nil || fs[0].Mountpoint != fmt.Sprintf("/hollow/hollow-%05d/images", i) {
				errs[i] = fmt.Errorf("node %d: ImageFsInfo = %+v, %v", i, fs, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for i, node := range f.Nodes() {
		if capacity, used := node.FsUsage(); capacity != int64(i+1)<<30 || used == 0 || node.Pulls() != 1 {
			t.Fatalf("node %d: capacity %d, used %d, pulls %d", i, capacity, used, node.Pulls())
		}
	}
	if f.Node(7).Name() != "hollow-00007" {
		t.Fatalf("node 7 is named %q", f.Node(7).Name())
	}

	// A second fleet on the same directory fails while the first serves, and leaves nothing listening.
	g, err := hollow.NewFleet(filepath.Dir(strings.TrimPrefix(f.Endpoint(0), "unix://")), 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Start(t.Context()); err == nil {
		t.Fatal("a second fleet started on sockets in use")
	}
	if _, err := hollow.NewFleet(t.TempDir(), 0, nil); err == nil {
		t.Fatal("NewFleet with 0 nodes succeeded")
	}
}

func TestNodeName(t *testing.T) {
	for _, tc := range []struct {
		i, last int
		want    string
	}{
		{0, 1, "hollow-00000"},
		{7, 50, "hollow-00007"},
		{9999, 10000, "hollow-09999"},
		{10000, 10001, "hollow-10000"},
		{99999, 100000, "hollow-99999"},
		{5, 100001, "hollow-000005"},
		{100000, 100001, "hollow-100000"},
	} {
		if got := hollow.NodeName(tc.i, tc.last); got != tc.want {
			t.Errorf("NodeName(%d, %d) = %q, want %q", tc.i, tc.last, got, tc.want)
		}
	}
	// The names of a fleet sort as their indexes.
	const n = 12000
	names := make([]string, n)
	for i := range n {
		names[i] = hollow.NodeName(i, n)
	}
	if !slices.IsSorted(names) {
		t.Fatal("the names of a 12,000-node fleet do not sort as their indexes")
	}
}

// TestPullDelay: a pull over DialWith's in-memory connection takes the runtime's PullLatency, and the
// image appears in ListImages when the pull returns (not before).
func TestPullDelay(t *testing.T) {
	const delay = 100 * time.Millisecond
	r := hollow.New(hollow.Options{Name: "hollow-00001", PullLatency: delay})
	c, stop, err := r.DialWith(t.Context(), hollow.DialOptions{BufferSize: 32 << 10, Client: cri.Config{Timeout: 5 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	pulled := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := c.PullImage(t.Context(), "registry.local/app:v2", nil, nil, nil)
		pulled <- err
	}()
	// While the pull waits, the image is not there.
	time.Sleep(delay / 4)
	if _, err := c.ImageStatus(t.Context(), "registry.local/app:v2"); !errors.Is(err, cri.ErrNotFound) {
		t.Fatalf("image status during the pull = %v, want ErrNotFound", err)
	}
	if err := <-pulled; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < delay {
		t.Fatalf("pull took %v, less than its %v delay", d, delay)
	}
	imgs, err := c.ListImages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(imgs) != 1 || !slices.Contains(imgs[0].RepoTags, "registry.local/app:v2") {
		t.Fatalf("images after the pull = %+v, want registry.local/app:v2", imgs)
	}
}
