package hollow

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/imagefleet/imagefleet/services/cri"
)

// Options configures a hollow runtime. The zero value is a working runtime named "hollow".
type Options struct {
	// Name is the node name: it appears in the image filesystem mountpoint (/hollow/<name>/images) and seeds
	// container and sandbox IDs (default "hollow").
	Name string
	// DefaultImageSize gives the size of a pulled image, or of an added image whose Size is 0, from its
	// normalized reference (default: a deterministic pseudo-random size of 5-300 MiB from a hash of the ref).
	DefaultImageSize func(ref string) int64
	// PullLatency is how long every pull takes; a pull whose context ends first fails with the context's
	// code (default 0).
	PullLatency time.Duration
	// Capacity is the image filesystem's capacity in bytes. CRI's ImageFsInfo carries no capacity (a real
	// node gets it from statfs), so it is only reported by Capacity and FsUsage for the demo to use, and
	// nothing is enforced (default 0: not reported).
	Capacity int64
	// PinnedRefs are references (normalized like pulls) or image IDs whose images ListImages reports
	// pinned, as containerd does for its sandbox image (default none).
	PinnedRefs []string
	// StopTimeout is how long Serve waits for calls in flight after its context ends before it cancels
	// them (default 2s). A pull held by BlockPulls is such a call.
	StopTimeout time.Duration
	// Logger receives the few lifecycle logs (default: discarded).
	Logger *slog.Logger
}

// Runtime is one hollow node's container runtime: images, pod sandboxes and containers in memory, served
// as the CRI RuntimeService and ImageService by Serve, StartUnix or Dial, and changed directly by the test
// helpers (AddImage, AddContainer, ...).
//
// Locks: mu guards the node's state; gate.mu guards pull gating; callsMu guards the call log. No two of
// them are ever held at the same time, so there is no lock order to keep.
type Runtime struct {
	name        string
	mountpoint  string
	sizeOf      func(string) int64
	latency     time.Duration
	capacity    int64
	stopTimeout time.Duration
	log         *slog.Logger
	pinned      map[string]bool // normalized refs and IDs from Options.PinnedRefs; read-only after New

	pulls, removes        atomic.Int64
	inFlight, maxInFlight atomic.Int64
	gate                  gate

	callsMu sync.Mutex
	calls   []string

	mu sync.RWMutex
	// images holds every image by ID. The values are shared with responses, so they are never changed
	// in place: a change stores a new message.
	images map[string]*runtimeapi.Image
	// refs maps every normalized tag (docker.io/library/nginx:latest) and digest reference
	// (docker.io/library/nginx@sha256:...) to an image ID.
	refs      map[string]string
	usedBytes uint64
	// imageList caches the images sorted by ID for ListImages; nil when stale. It is stored only while
	// mu is held (for reading is enough: the state cannot change then) and cleared under the write lock.
	imageList  atomic.Pointer[[]*runtimeapi.Image]
	sandboxes  map[string]*runtimeapi.PodSandbox // values never changed in place
	containers map[string]*container
	// containerList caches the containers sorted by ID, like imageList.
	containerList atomic.Pointer[[]*container]
	seq           uint64
	failPulls     map[string]error      // normalized ref -> the error its pulls return
	auth          map[string]credential // registry host -> the credential its pulls need
}

// container is one container. pb is shared with responses and replaced, never changed in place.
type container struct {
	pb         *runtimeapi.Container
	startedAt  int64
	finishedAt int64
	exitCode   int32
	reason     string
}

type credential struct{ user, pass string }

// maxCalls bounds the call log per node, so a long demo on a thousand nodes does not grow without end.
const maxCalls = 4096

// New returns a hollow runtime with no images, sandboxes or containers.
func New(opts Options) *Runtime {
	r := &Runtime{
		name:        cmp.Or(opts.Name, "hollow"),
		sizeOf:      opts.DefaultImageSize,
		latency:     opts.PullLatency,
		capacity:    opts.Capacity,
		stopTimeout: cmp.Or(opts.StopTimeout, 2*time.Second),
		log:         opts.Logger,
		images:      map[string]*runtimeapi.Image{},
		refs:        map[string]string{},
		sandboxes:   map[string]*runtimeapi.PodSandbox{},
		containers:  map[string]*container{},
	}
	r.mountpoint = "/hollow/" + r.name + "/images"
	if r.sizeOf == nil {
		r.sizeOf = defaultImageSize
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if len(opts.PinnedRefs) > 0 {
		r.pinned = make(map[string]bool, len(opts.PinnedRefs))
		for _, ref := range opts.PinnedRefs {
			r.pinned[ref] = true // an ID, or a reference that does not parse, matches as written
			if named, err := normalize(ref); err == nil {
				r.pinned[named.String()] = true
			}
		}
	}
	return r
}

// Name returns the node name.
func (r *Runtime) Name() string { return r.name }

// Capacity returns Options.Capacity: the image filesystem capacity the demo reports for this node.
func (r *Runtime) Capacity() int64 { return r.capacity }

// FsUsage returns the image filesystem's capacity (Options.Capacity) and used bytes (the sum of image
// sizes, what ImageFsInfo reports), the two figures the kubelet's image GC takes from statfs and CRI.
func (r *Runtime) FsUsage() (capacity, used int64) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.capacity, int64(r.usedBytes)
}

// newIDLocked returns a deterministic 64-hex-digit ID, unique within the node, as containerd's IDs look.
// r.mu must be held for writing.
func (r *Runtime) newIDLocked(kind string) string {
	r.seq++
	sum := sha256.Sum256([]byte(r.name + "/" + kind + "/" + strconv.FormatUint(r.seq, 10)))
	return hex.EncodeToString(sum[:])
}

// resolveLocked finds the image s names: an image ID (with or without sha256:), a tag or a digest
// reference, normalized as pulls are. r.mu must be held.
func (r *Runtime) resolveLocked(s string) *runtimeapi.Image {
	if s == "" {
		return nil
	}
	if im, ok := r.images[s]; ok {
		return im
	}
	if isHex64(s) {
		return r.images["sha256:"+s]
	}
	named, err := normalize(s)
	if err != nil {
		return nil
	}
	if id, ok := r.refs[named.String()]; ok {
		return r.images[id]
	}
	return nil
}

// isPinned reports whether Options.PinnedRefs names im by ID, tag or digest reference.
func (r *Runtime) isPinned(im *runtimeapi.Image) bool {
	if r.pinned[im.Id] {
		return true
	}
	for _, ref := range slices.Concat(im.RepoTags, im.RepoDigests) {
		if r.pinned[ref] {
			return true
		}
	}
	return false
}

// putImageLocked stores im (a new message) under its ID, points its tags and digests at it (taking a
// tag from any image that had it, as a registry tag moves) and keeps the used bytes. r.mu must be held
// for writing.
func (r *Runtime) putImageLocked(im *runtimeapi.Image) {
	if old, ok := r.images[im.Id]; ok {
		r.usedBytes -= old.Size
		for _, ref := range slices.Concat(old.RepoTags, old.RepoDigests) {
			if r.refs[ref] == im.Id && !slices.Contains(im.RepoTags, ref) && !slices.Contains(im.RepoDigests, ref) {
				delete(r.refs, ref)
			}
		}
	}
	for _, ref := range slices.Concat(im.RepoTags, im.RepoDigests) {
		if prev, ok := r.refs[ref]; ok && prev != im.Id {
			r.dropRefLocked(prev, ref)
		}
		r.refs[ref] = im.Id
	}
	r.images[im.Id] = im
	r.usedBytes += im.Size
	r.imageList.Store(nil)
}

// dropRefLocked takes ref off image id (a tag that moved to another image).
func (r *Runtime) dropRefLocked(id, ref string) {
	im, ok := r.images[id]
	if !ok {
		return
	}
	next := cloneImage(im)
	next.RepoTags = slices.DeleteFunc(next.RepoTags, func(t string) bool { return t == ref })
	next.RepoDigests = slices.DeleteFunc(next.RepoDigests, func(t string) bool { return t == ref })
	r.images[id] = next
}

// deleteImageLocked removes an image with all its references, as CRI RemoveImage does.
func (r *Runtime) deleteImageLocked(im *runtimeapi.Image) {
	for _, ref := range slices.Concat(im.RepoTags, im.RepoDigests) {
		if r.refs[ref] == im.Id {
			delete(r.refs, ref)
		}
	}
	delete(r.images, im.Id)
	r.usedBytes -= im.Size
	r.imageList.Store(nil)
}

func cloneImage(im *runtimeapi.Image) *runtimeapi.Image {
	return &runtimeapi.Image{Id: im.Id, RepoTags: slices.Clone(im.RepoTags), RepoDigests: slices.Clone(im.RepoDigests),
		Size: im.Size, Pinned: im.Pinned}
}

// listImages returns every image sorted by ID. The slice and its messages are shared: read only.
func (r *Runtime) listImages() []*runtimeapi.Image {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if l := r.imageList.Load(); l != nil {
		return *l
	}
	l := make([]*runtimeapi.Image, 0, len(r.images))
	for _, im := range r.images {
		l = append(l, im)
	}
	slices.SortFunc(l, func(a, b *runtimeapi.Image) int { return cmp.Compare(a.Id, b.Id) })
	r.imageList.Store(&l) // under the read lock: no writer can have changed the images since we read them
	return l
}

// listContainersLocked returns every container sorted by ID; r.mu must be held. Read only.
func (r *Runtime) listContainersLocked() []*container {
	if l := r.containerList.Load(); l != nil {
		return *l
	}
	l := make([]*container, 0, len(r.containers))
	for _, c := range r.containers {
		l = append(l, c)
	}
	slices.SortFunc(l, func(a, b *container) int { return cmp.Compare(a.pb.Id, b.pb.Id) })
	r.containerList.Store(&l)
	return l
}

// AddImage stores an image directly, as if it had been pulled. Tags are normalized like pulls; an empty
// ID is derived from the first tag as a pull would; a zero Size comes from Options.DefaultImageSize; each
// tag gets a RepoDigest unless RepoDigests is given. It returns the image as stored.
func (r *Runtime) AddImage(img cri.Image) (cri.Image, error) {
	im := &runtimeapi.Image{Id: img.ID, Size: uint64(img.Size), Pinned: img.Pinned}
	for _, t := range img.RepoTags {
		named, err := normalize(t)
		if err != nil {
			return cri.Image{}, fmt.Errorf("add image: %w", err)
		}
		im.RepoTags = append(im.RepoTags, named.String())
		if len(img.RepoDigests) == 0 {
			im.RepoDigests = append(im.RepoDigests, repoDigest(named))
		}
	}
	for _, d := range img.RepoDigests {
		named, err := normalize(d)
		if err != nil {
			return cri.Image{}, fmt.Errorf("add image: %w", err)
		}
		im.RepoDigests = append(im.RepoDigests, named.String())
	}
	switch {
	case im.Id == "" && len(im.RepoTags) > 0:
		im.Id = imageID(im.RepoTags[0])
	case im.Id == "" && len(im.RepoDigests) > 0:
		im.Id = imageID(im.RepoDigests[0])
	case im.Id == "":
		return cri.Image{}, fmt.Errorf("add image: neither an ID nor a tag")
	case isHex64(im.Id):
		im.Id = "sha256:" + im.Id
	}
	if im.Size == 0 {
		im.Size = uint64(r.sizeOf(cmp.Or(firstOf(im.RepoTags), firstOf(im.RepoDigests), im.Id)))
	}
	im.Pinned = im.Pinned || r.isPinned(im)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.putImageLocked(im)
	return fromCRIImage(im), nil
}

func firstOf(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

func fromCRIImage(im *runtimeapi.Image) cri.Image {
	return cri.Image{ID: im.Id, RepoTags: slices.Clone(im.RepoTags), RepoDigests: slices.Clone(im.RepoDigests),
		Size: int64(im.Size), Pinned: im.Pinned}
}

// Images returns every image, sorted by ID.
func (r *Runtime) Images() []cri.Image {
	l := r.listImages()
	out := make([]cri.Image, len(l))
	for i, im := range l {
		out[i] = fromCRIImage(im)
	}
	return out
}

// Image returns the image ref (an ID, tag or digest reference) names.
func (r *Runtime) Image(ref string) (cri.Image, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	im := r.resolveLocked(ref)
	if im == nil {
		return cri.Image{}, false
	}
	return fromCRIImage(im), true
}

// SetImageSize changes the size of the image ref names (an ID, tag or digest reference).
func (r *Runtime) SetImageSize(ref string, size int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	im := r.resolveLocked(ref)
	if im == nil {
		return fmt.Errorf("set image size %q: %w", ref, cri.ErrNotFound)
	}
	next := cloneImage(im)
	next.Size = uint64(size)
	r.putImageLocked(next)
	return nil
}

// AddContainer stores a container directly, as if the kubelet had created it. c.ImageID is taken as
// written (it may name an image the node no longer has); when it is empty, c.Image (an ID or reference)
// must resolve to a present image. An empty PodSandboxID gets a new ready sandbox; an unknown one is
// created ready. An empty ID is generated. It returns the container's ID.
func (r *Runtime) AddContainer(c cri.Container) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	imageID := c.ImageID
	if imageID == "" {
		im := r.resolveLocked(c.Image)
		if im == nil {
			return "", fmt.Errorf("add container %q: image %q: %w", c.Name, c.Image, cri.ErrNotFound)
		}
		imageID = im.Id
	} else if im := r.resolveLocked(imageID); im != nil {
		imageID = im.Id
	}
	if c.ID == "" {
		c.ID = r.newIDLocked("container")
	}
	if _, ok := r.containers[c.ID]; ok {
		return "", fmt.Errorf("add container %q: ID %s exists", c.Name, c.ID)
	}
	now := time.Now().UnixNano()
	if _, ok := r.sandboxes[c.PodSandboxID]; !ok {
		if c.PodSandboxID == "" {
			c.PodSandboxID = r.newIDLocked("sandbox")
		}
		r.sandboxes[c.PodSandboxID] = &runtimeapi.PodSandbox{Id: c.PodSandboxID, State: runtimeapi.PodSandboxState_SANDBOX_READY,
			Metadata: &runtimeapi.PodSandboxMetadata{Name: c.Name, Namespace: "default", Uid: c.PodSandboxID}, CreatedAt: now}
	}
	state := runtimeapi.ContainerState(c.State)
	ct := &container{pb: &runtimeapi.Container{Id: c.ID, PodSandboxId: c.PodSandboxID,
		Metadata: &runtimeapi.ContainerMetadata{Name: c.Name}, Image: &runtimeapi.ImageSpec{Image: cmp.Or(c.Image, imageID)},
		ImageRef: imageID, ImageId: imageID, State: state, CreatedAt: now, Labels: c.Labels}}
	if state == runtimeapi.ContainerState_CONTAINER_RUNNING || state == runtimeapi.ContainerState_CONTAINER_EXITED {
		ct.startedAt = now
	}
	if state == runtimeapi.ContainerState_CONTAINER_EXITED {
		ct.finishedAt, ct.reason = now, "Completed"
	}
	r.containers[c.ID] = ct
	r.containerList.Store(nil)
	return c.ID, nil
}

// SetContainerState moves a container to state (a running container exits, for example).
func (r *Runtime) SetContainerState(id string, state cri.ContainerState) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	ct, ok := r.containers[id]
	if !ok {
		return fmt.Errorf("set container state %s: %w", id, cri.ErrNotFound)
	}
	r.setStateLocked(ct, runtimeapi.ContainerState(state))
	return nil
}

// setStateLocked moves ct to state, recording the start and finish times.
func (r *Runtime) setStateLocked(ct *container, state runtimeapi.ContainerState) {
	if ct.pb.State == state {
		return
	}
	now := time.Now().UnixNano()
	switch state {
	case runtimeapi.ContainerState_CONTAINER_RUNNING:
		ct.startedAt = now
	case runtimeapi.ContainerState_CONTAINER_EXITED:
		ct.finishedAt, ct.reason = now, "Completed"
		if ct.startedAt == 0 {
			ct.startedAt = now
		}
	}
	old := ct.pb
	ct.pb = &runtimeapi.Container{Id: old.Id, PodSandboxId: old.PodSandboxId, Metadata: old.Metadata, Image: old.Image,
		ImageRef: old.ImageRef, ImageId: old.ImageId, State: state, CreatedAt: old.CreatedAt, Labels: old.Labels,
		Annotations: old.Annotations}
}

// RemoveContainer removes a container directly; a missing one is no error.
func (r *Runtime) RemoveContainer(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.containers[id]; ok {
		delete(r.containers, id)
		r.containerList.Store(nil)
	}
}

// Containers returns every container, sorted by ID.
func (r *Runtime) Containers() []cri.Container {
	r.mu.RLock()
	defer r.mu.RUnlock()
	l := r.listContainersLocked()
	out := make([]cri.Container, len(l))
	for i, ct := range l {
		out[i] = cri.Container{ID: ct.pb.Id, PodSandboxID: ct.pb.PodSandboxId, Name: ct.pb.GetMetadata().GetName(),
			Image: ct.pb.GetImage().GetImage(), ImageID: ct.pb.ImageId, State: cri.ContainerState(ct.pb.State), Labels: ct.pb.Labels}
	}
	return out
}

// FailPulls makes every pull of ref (normalized) fail with err, which should be a gRPC status error such
// as status.Error(codes.Unknown, "RegistryUnavailable: ..."); a nil err stops the failures.
func (r *Runtime) FailPulls(ref string, err error) {
	key := ref
	if named, perr := normalize(ref); perr == nil {
		key = named.String()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		delete(r.failPulls, key)
		return
	}
	if r.failPulls == nil {
		r.failPulls = map[string]error{}
	}
	r.failPulls[key] = err
}

// RequireAuth makes pulls from registryHost (as in the reference: "docker.io", "127.0.0.1:5000") need an
// AuthConfig with this user and password (or the base64 "user:pass" Auth field); without it they fail as
// containerd fails on a registry's 401. An empty user removes the requirement.
func (r *Runtime) RequireAuth(registryHost, user, pass string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if user == "" {
		delete(r.auth, registryHost)
		return
	}
	if r.auth == nil {
		r.auth = map[string]credential{}
	}
	r.auth[registryHost] = credential{user: user, pass: pass}
}

// BlockPulls holds every pull from now on (after it counts as in flight, before it stores the image)
// until UnblockPulls lets it through or UnblockAllPulls ends the blocking. A held pull whose context ends
// fails with the context's code.
func (r *Runtime) BlockPulls() { r.gate.block() }

// UnblockPulls lets n held or future pulls through; blocking goes on for the rest.
func (r *Runtime) UnblockPulls(n int) { r.gate.release(n) }

// UnblockAllPulls ends the blocking: every held pull and every later one goes through.
func (r *Runtime) UnblockAllPulls() { r.gate.open() }

// BlockedPulls returns how many pulls are held now.
func (r *Runtime) BlockedPulls() int { return r.gate.held() }

// Pulls returns how many PullImage calls the runtime has received, failed ones included.
func (r *Runtime) Pulls() int64 { return r.pulls.Load() }

// InFlightPulls returns how many PullImage calls are in progress now (held ones included).
func (r *Runtime) InFlightPulls() int64 { return r.inFlight.Load() }

// MaxInFlightPulls returns the most PullImage calls that were ever in progress at once.
func (r *Runtime) MaxInFlightPulls() int64 { return r.maxInFlight.Load() }

// Removes returns how many RemoveImage calls the runtime has received, for missing images too.
func (r *Runtime) Removes() int64 { return r.removes.Load() }

// Calls returns the CRI methods called over gRPC, oldest first (the latest 4,096 at most), as
// "PullImage", "ListImages" ...
func (r *Runtime) Calls() []string {
	r.callsMu.Lock()
	defer r.callsMu.Unlock()
	return slices.Clone(r.calls)
}

// ResetCalls empties the call log.
func (r *Runtime) ResetCalls() {
	r.callsMu.Lock()
	defer r.callsMu.Unlock()
	r.calls = nil
}

func (r *Runtime) record(method string) {
	r.callsMu.Lock()
	defer r.callsMu.Unlock()
	if len(r.calls) >= maxCalls {
		r.calls = append(r.calls[:0], r.calls[maxCalls/2:]...)
	}
	r.calls = append(r.calls, method)
}

// pullStarted counts a pull in flight and keeps the maximum; the returned func ends it.
func (r *Runtime) pullStarted() func() {
	r.pulls.Add(1)
	n := r.inFlight.Add(1)
	for {
		m := r.maxInFlight.Load()
		if n <= m || r.maxInFlight.CompareAndSwap(m, n) {
			break
		}
	}
	return func() { r.inFlight.Add(-1) }
}
