package integration_test

import (
	"errors"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/cri"
)

const mib = 1 << 20

// TestLabSmoke proves the lab's parts are real: a registry on loopback, images pushed to it, a private
// containerd on a 96 MiB tmpfs that pulls them, runs a pod, reports its image filesystem, removes an image
// and keeps the rest across a restart.
func TestLabSmoke(t *testing.T) {
	began := time.Now()
	ctx := t.Context()
	reg := lab.StartRegistry(t, lab.RegistryOptions{})

	lab.PushBusybox(t, reg.Host(), "lab/pause:1")
	pause := reg.Ref("lab/pause:1")
	sizes := map[string]int64{"lab/small:1": 2 * mib, "lab/medium:1": 6 * mib, "lab/large:1": 12 * mib}
	pushed := map[string]lab.Pushed{}
	for repoTag, size := range sizes {
		p, err := lab.Push(ctx, reg.Host(), repoTag, size)
		if err != nil {
			t.Fatal(err)
		}
		if d := p.Size - size; d < -4096 || d > 4096 {
			t.Errorf("pushed %s: size %d, want about %d", repoTag, p.Size, size)
		}
		pushed[p.Ref] = p
	}

	c := lab.StartContainerd(t, lab.Options{SandboxImage: pause, TmpfsSize: "96m"})
	cl := c.Client()
	t.Logf("containerd up at %s (snapshotter %s) after %s", c.Endpoint(), c.Snapshotter(), time.Since(began).Round(time.Millisecond))

	reg.ResetStats()
	for ref, p := range pushed {
		id, err := cl.PullImage(ctx, ref, nil, nil, nil)
		if err != nil {
			t.Fatalf("pull %s: %v", ref, err)
		}
		if id != p.ID {
			t.Errorf("pull %s: image ID %s, want the config digest %s", ref, id, p.ID)
		}
	}
	pauseID, err := cl.PullImage(ctx, pause, nil, nil, nil)
	if err != nil {
		t.Fatalf("pull %s: %v", pause, err)
	}
	if st := reg.Stats(); st.ManifestReads < 4 || st.BlobReads < 8 {
		t.Errorf("registry stats after 4 pulls: %+v, want at least 4 manifest and 8 blob reads", st)
	}

	images, err := cl.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for ref, p := range pushed {
		im, ok := findImage(images, p.ID)
		if !ok {
			t.Errorf("ListImages: %s (%s) missing", ref, p.ID)
			continue
		}
		if !slices.Contains(im.RepoTags, ref) {
			t.Errorf("ListImages: %s has tags %v, want %s", p.ID, im.RepoTags, ref)
		}
		if im.Size != p.Size {
			t.Errorf("ListImages: %s size %d, want the pushed size %d", ref, im.Size, p.Size)
		}
	}

	sandboxID, containerID := lab.RunPod(t, c, "smoke", pause)
	containers, err := cl.ListContainers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(containers, func(ct cri.Container) bool { return ct.ID == containerID })
	if i < 0 {
		t.Fatalf("ListContainers: container %s of pod %s missing from %+v", containerID, sandboxID, containers)
	}
	if ct := containers[i]; ct.ImageID != pauseID || ct.State != cri.ContainerRunning || ct.PodSandboxID != sandboxID {
		t.Errorf("ListContainers: %+v, want image ID %s, running, in sandbox %s", ct, pauseID, sandboxID)
	}

	// ImageFsInfo gives the mountpoint and used bytes; capacity comes from statfs, as in the kubelet.
	// Used bytes are refreshed every StatsCollectPeriod, hence the poll.
	var fs cri.FsInfo
	bustest.Eventually(t, "ImageFsInfo used bytes > 0", 15*time.Second, func() error {
		fss, err := cl.ImageFsInfo(ctx)
		if err != nil || len(fss) == 0 {
			return fmt.Errorf("ImageFsInfo: %v %v", fss, err)
		}
		fs = fss[0]
		if fs.UsedBytes > 0 {
			return nil
		}
		return fmt.Errorf("%+v", fs)
	})
	if !strings.HasPrefix(fs.Mountpoint, c.Root()+"/") {
		t.Errorf("ImageFsInfo mountpoint %s is not on the tmpfs %s", fs.Mountpoint, c.Root())
	}
	capacity, available, err := cri.Statfs(fs.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	if capacity != 96*mib {
		t.Errorf("statfs %s: capacity %d, want 96 MiB (%d)", fs.Mountpoint, capacity, 96*mib)
	}
	// The content store and the unpacked snapshots both sit on the tmpfs: about twice the 20 MiB pushed.
	if used := capacity - available; used < 30*mib {
		t.Errorf("statfs %s: %d bytes used, want at least 30 MiB for 20 MiB of images stored twice", fs.Mountpoint, used)
	}
	t.Logf("image fs %s: capacity %d MiB, used %d MiB (statfs), %d MiB (ImageFsInfo)", fs.Mountpoint, capacity/mib, (capacity-available)/mib, fs.UsedBytes/mib)

	removed := pushed[reg.Ref("lab/large:1")]
	if err := cl.RemoveImage(ctx, removed.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ImageStatus(ctx, removed.ID); !errors.Is(err, cri.ErrNotFound) {
		t.Errorf("ImageStatus of removed %s: %v, want ErrNotFound", removed.ID, err)
	}
	if err := cl.RemoveImage(ctx, removed.ID); err != nil && !errors.Is(err, cri.ErrNotFound) {
		t.Errorf("RemoveImage again: %v, want success or ErrNotFound", err)
	}

	restarted := time.Now()
	c.Restart()
	t.Logf("containerd restarted in %s", time.Since(restarted).Round(time.Millisecond))
	images, err = cl.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for ref, p := range pushed {
		_, ok := findImage(images, p.ID)
		if want := p.ID != removed.ID; ok != want {
			t.Errorf("after restart: %s listed %v, want %v", ref, ok, want)
		}
	}
	if _, ok := findImage(images, pauseID); !ok {
		t.Errorf("after restart: pause image %s missing", pauseID)
	}
	containers, err = cl.ListContainers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(containers, func(ct cri.Container) bool { return ct.ID == containerID && ct.State == cri.ContainerRunning }) {
		t.Errorf("after restart: container %s not running: %+v", containerID, containers)
	}
	t.Logf("lab smoke test took %s", time.Since(began).Round(time.Millisecond))
}

// TestLabRegistryAuth pulls from a registry that wants basic auth: with the credentials the pull works,
// without them it fails, and the registry saw the rejected requests.
func TestLabRegistryAuth(t *testing.T) {
	ctx := t.Context()
	reg := lab.StartRegistry(t, lab.RegistryOptions{User: "lab", Password: "s3cret"})
	if _, err := lab.Push(ctx, reg.Host(), "lab/private:1", 64<<10); err == nil {
		t.Fatal("push without credentials succeeded, want 401")
	}
	p, err := lab.Push(ctx, reg.Host(), "lab/private:1", 64<<10, lab.WithAuth("lab", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	c := lab.StartContainerd(t, lab.Options{TmpfsSize: "16m"})
	reg.ResetStats()
	if _, err := c.Client().PullImage(ctx, p.Ref, nil, nil, nil); err == nil {
		t.Fatalf("pull %s without credentials succeeded", p.Ref)
	} else {
		t.Logf("pull without credentials: %v", err)
	}
	if st := reg.Stats(); st.Unauthorized == 0 {
		t.Errorf("registry stats %+v: want rejected requests", st)
	}
	// ServerAddress stays empty: containerd 1.6 parses it as a URL, so a bare "127.0.0.1:PORT" fails the
	// pull ("first path segment in URL cannot contain colon") and a bare host name drops the credentials.
	id, err := c.Client().PullImage(ctx, p.Ref, &cri.AuthConfig{Username: "lab", Password: "s3cret"}, nil, nil)
	if err != nil {
		t.Fatalf("pull %s with credentials: %v", p.Ref, err)
	}
	if id != p.ID {
		t.Errorf("pull %s: image ID %s, want %s", p.Ref, id, p.ID)
	}
}

// TestLabConcurrentPulls checks that the registry measures pulls that overlap: three pulls started at once,
// each held 300ms per read, are seen in flight together.
func TestLabConcurrentPulls(t *testing.T) {
	ctx := t.Context()
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	var refs []string
	for i := range 3 {
		refs = append(refs, reg.Ref(fmt.Sprintf("lab/par-%d:1", i)))
		lab.PushImage(t, reg.Host(), fmt.Sprintf("lab/par-%d:1", i), 256<<10)
	}
	c := lab.StartContainerd(t, lab.Options{TmpfsSize: "16m"})
	reg.ResetStats()
	reg.SetDelay(300 * time.Millisecond)
	errs := make(chan error, len(refs))
	for _, ref := range refs {
		go func() {
			_, err := c.Client().PullImage(ctx, ref, nil, nil, nil)
			errs <- err
		}()
	}
	for range refs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if st := reg.Stats(); st.MaxReposInFlight != 3 || st.InFlight != 0 {
		t.Errorf("registry stats %+v: want 3 repositories read at once and none in flight now", st)
	}
}

// TestLabCleanupAfterKill runs a pod on the native snapshotter, crashes containerd (SIGKILL), restarts it,
// crashes it again and leaves the rest to the lab: after the subtest no process, mount or directory of that
// containerd may remain.
func TestLabCleanupAfterKill(t *testing.T) {
	reg := lab.StartRegistry(t, lab.RegistryOptions{})
	lab.PushBusybox(t, reg.Host(), "lab/pause:1")
	pause := reg.Ref("lab/pause:1")
	var dir string
	t.Run("crash", func(t *testing.T) {
		c := lab.StartContainerd(t, lab.Options{SandboxImage: pause, TmpfsSize: "16m", Snapshotter: "native"})
		dir = c.Dir()
		_, containerID := lab.RunPod(t, c, "crash", pause)
		if d := c.Diagnose(); !strings.HasPrefix(d, "containerd pid ") || !strings.Contains(d, "running true; connect: ok; listening sockets bound to the path 1, one of them containerd's true;") {
			t.Errorf("the diagnosis of a running containerd:\n%s", d)
		}
		c.Kill()
		if c.Running() {
			t.Fatal("containerd runs after Kill")
		}
		// The killed containerd's socket file stays, with nothing listening on it.
		if d := c.Diagnose(); !strings.Contains(d, "running false; connect: dial unix") || !strings.Contains(d, "connection refused; listening sockets bound to the path 0, one of them containerd's false;") {
			t.Errorf("the diagnosis of a killed containerd:\n%s", d)
		}
		c.Start()
		containers, err := c.Client().ListContainers(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		// The shim outlives containerd, so the container still runs after the crash.
		if !slices.ContainsFunc(containers, func(ct cri.Container) bool { return ct.ID == containerID && ct.State == cri.ContainerRunning }) {
			t.Errorf("after a crash and restart: container %s not running: %+v", containerID, containers)
		}
		c.Kill()
	})
	if out, err := exec.Command("findmnt", "--list", "--noheadings", "--output", "TARGET").Output(); err != nil {
		t.Fatal(err)
	} else if strings.Contains(string(out), dir) {
		t.Errorf("mounts left under %s:\n%s", dir, out)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s left behind: %v", dir, err)
	}
	if pids, err := lab.ProcessesMentioning(dir); err != nil {
		t.Fatal(err)
	} else if len(pids) > 0 {
		t.Errorf("processes of %s left: %v", dir, pids)
	}
}

func findImage(images []cri.Image, id string) (cri.Image, bool) {
	i := slices.IndexFunc(images, func(im cri.Image) bool { return im.ID == id })
	if i < 0 {
		return cri.Image{}, false
	}
	return images[i], true
}
