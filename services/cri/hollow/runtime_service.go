package hollow

import (
	"cmp"
	"context"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// runtimeService is the runtime's CRI RuntimeService (see imageService for why it is a type of its own).
// Sandboxes and containers have no processes: a state is only a field.
type runtimeService struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	r *Runtime
}

// Version, RuntimeName and RuntimeVersion of the hollow runtime; Version is the CRI's kubeAPIVersion,
// as containerd reports it.
const (
	runtimeName       = "hollow"
	runtimeVersion    = "0.1.0"
	runtimeAPIVersion = "v1"
	kubeAPIVersion    = "0.1.0"
)

func (s *runtimeService) Version(context.Context, *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	s.r.record("Version")
	return &runtimeapi.VersionResponse{Version: kubeAPIVersion, RuntimeName: runtimeName,
		RuntimeVersion: runtimeVersion, RuntimeApiVersion: runtimeAPIVersion}, nil
}

// Status reports the runtime and its network ready.
func (s *runtimeService) Status(context.Context, *runtimeapi.StatusRequest) (*runtimeapi.StatusResponse, error) {
	s.r.record("Status")
	return &runtimeapi.StatusResponse{Status: &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}}, nil
}

func (s *runtimeService) RunPodSandbox(_ context.Context, req *runtimeapi.RunPodSandboxRequest) (*runtimeapi.RunPodSandboxResponse, error) {
	r := s.r
	r.record("RunPodSandbox")
	cfg := req.GetConfig()
	if cfg.GetMetadata() == nil {
		return nil, status.Error(codes.InvalidArgument, "sandbox config must include metadata")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	id := r.newIDLocked("sandbox")
	r.sandboxes[id] = &runtimeapi.PodSandbox{Id: id, Metadata: cfg.Metadata, State: runtimeapi.PodSandboxState_SANDBOX_READY,
		CreatedAt: time.Now().UnixNano(), Labels: cfg.Labels, Annotations: cfg.Annotations, RuntimeHandler: req.RuntimeHandler}
	return &runtimeapi.RunPodSandboxResponse{PodSandboxId: id}, nil
}

// StopPodSandbox marks the sandbox not ready and exits its containers; a missing sandbox is NotFound, as
// containerd answers.
func (s *runtimeService) StopPodSandbox(_ context.Context, req *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	r := s.r
	r.record("StopPodSandbox")
	r.mu.Lock()
	defer r.mu.Unlock()
	sb, ok := r.sandboxes[req.PodSandboxId]
	if !ok {
		return nil, sandboxNotFound(req.PodSandboxId)
	}
	for _, ct := range r.containers {
		if ct.pb.PodSandboxId == sb.Id && ct.pb.State != runtimeapi.ContainerState_CONTAINER_EXITED {
			r.setStateLocked(ct, runtimeapi.ContainerState_CONTAINER_EXITED)
		}
	}
	if sb.State != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
		r.sandboxes[sb.Id] = &runtimeapi.PodSandbox{Id: sb.Id, Metadata: sb.Metadata, State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY,
			CreatedAt: sb.CreatedAt, Labels: sb.Labels, Annotations: sb.Annotations, RuntimeHandler: sb.RuntimeHandler}
	}
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

// RemovePodSandbox removes the sandbox and its containers; a missing sandbox is success.
func (s *runtimeService) RemovePodSandbox(_ context.Context, req *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	r := s.r
	r.record("RemovePodSandbox")
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.sandboxes[req.PodSandboxId]; !ok {
		return &runtimeapi.RemovePodSandboxResponse{}, nil
	}
	delete(r.sandboxes, req.PodSandboxId)
	for id, ct := range r.containers {
		if ct.pb.PodSandboxId == req.PodSandboxId {
			delete(r.containers, id)
		}
	}
	r.containerList.Store(nil)
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

func (s *runtimeService) PodSandboxStatus(_ context.Context, req *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	r := s.r
	r.record("PodSandboxStatus")
	r.mu.RLock()
	defer r.mu.RUnlock()
	sb, ok := r.sandboxes[req.PodSandboxId]
	if !ok {
		return nil, sandboxNotFound(req.PodSandboxId)
	}
	return &runtimeapi.PodSandboxStatusResponse{Status: &runtimeapi.PodSandboxStatus{Id: sb.Id, Metadata: sb.Metadata,
		State: sb.State, CreatedAt: sb.CreatedAt, Labels: sb.Labels, Annotations: sb.Annotations, RuntimeHandler: sb.RuntimeHandler,
		Network: &runtimeapi.PodSandboxNetworkStatus{Ip: "127.0.0.1"}, // host network
	}, Timestamp: time.Now().UnixNano()}, nil
}

func (s *runtimeService) ListPodSandbox(_ context.Context, req *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	s.r.record("ListPodSandbox")
	return &runtimeapi.ListPodSandboxResponse{Items: s.r.filterSandboxes(req.GetFilter())}, nil
}

func (s *runtimeService) StreamPodSandboxes(req *runtimeapi.StreamPodSandboxesRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamPodSandboxesResponse]) error {
	s.r.record("StreamPodSandboxes")
	return sendChunks(s.r.filterSandboxes(req.GetFilter()), func(l []*runtimeapi.PodSandbox) error {
		return stream.Send(&runtimeapi.StreamPodSandboxesResponse{PodSandboxes: l})
	})
}

func (r *Runtime) filterSandboxes(f *runtimeapi.PodSandboxFilter) []*runtimeapi.PodSandbox {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []*runtimeapi.PodSandbox
	for _, sb := range r.sandboxes {
		if f.GetId() != "" && sb.Id != f.Id ||
			f.GetState() != nil && sb.State != f.State.State ||
			!matchLabels(sb.Labels, f.GetLabelSelector()) {
			continue
		}
		out = append(out, sb)
	}
	slices.SortFunc(out, func(a, b *runtimeapi.PodSandbox) int { return cmp.Compare(a.Id, b.Id) })
	return out
}

func matchLabels(labels, selector map[string]string) bool {
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// CreateContainer needs the sandbox and the image (an ID or a reference) to be present; the container's
// ImageId and ImageRef are the image's ID, its Image spec is the one given.
func (s *runtimeService) CreateContainer(_ context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	r := s.r
	r.record("CreateContainer")
	cfg := req.GetConfig()
	if cfg.GetMetadata() == nil || cfg.GetImage() == nil {
		return nil, status.Error(codes.InvalidArgument, "container config must include metadata and image")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.sandboxes[req.PodSandboxId]; !ok {
		return nil, sandboxNotFound(req.PodSandboxId)
	}
	im := r.resolveLocked(cfg.Image.Image)
	if im == nil {
		return nil, status.Errorf(codes.NotFound, "failed to get image %q: not found", cfg.Image.Image)
	}
	id := r.newIDLocked("container")
	r.containers[id] = &container{pb: &runtimeapi.Container{Id: id, PodSandboxId: req.PodSandboxId, Metadata: cfg.Metadata,
		Image: cfg.Image, ImageRef: im.Id, ImageId: im.Id, State: runtimeapi.ContainerState_CONTAINER_CREATED,
		CreatedAt: time.Now().UnixNano(), Labels: cfg.Labels, Annotations: cfg.Annotations}}
	r.containerList.Store(nil)
	return &runtimeapi.CreateContainerResponse{ContainerId: id}, nil
}

func (s *runtimeService) StartContainer(_ context.Context, req *runtimeapi.StartContainerRequest) (*runtimeapi.StartContainerResponse, error) {
	r := s.r
	r.record("StartContainer")
	r.mu.Lock()
	defer r.mu.Unlock()
	ct, ok := r.containers[req.ContainerId]
	if !ok {
		return nil, containerNotFound(req.ContainerId)
	}
	if ct.pb.State != runtimeapi.ContainerState_CONTAINER_CREATED {
		return nil, status.Errorf(codes.FailedPrecondition, "container %q is in %s state", req.ContainerId, ct.pb.State)
	}
	r.setStateLocked(ct, runtimeapi.ContainerState_CONTAINER_RUNNING)
	return &runtimeapi.StartContainerResponse{}, nil
}

// StopContainer exits the container at once (there is no process to wait for); stopping an exited
// container is success.
func (s *runtimeService) StopContainer(_ context.Context, req *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	r := s.r
	r.record("StopContainer")
	r.mu.Lock()
	defer r.mu.Unlock()
	ct, ok := r.containers[req.ContainerId]
	if !ok {
		return nil, containerNotFound(req.ContainerId)
	}
	r.setStateLocked(ct, runtimeapi.ContainerState_CONTAINER_EXITED)
	return &runtimeapi.StopContainerResponse{}, nil
}

// RemoveContainer removes the container; a missing one is success.
func (s *runtimeService) RemoveContainer(_ context.Context, req *runtimeapi.RemoveContainerRequest) (*runtimeapi.RemoveContainerResponse, error) {
	s.r.record("RemoveContainer")
	s.r.RemoveContainer(req.ContainerId)
	return &runtimeapi.RemoveContainerResponse{}, nil
}

func (s *runtimeService) ListContainers(_ context.Context, req *runtimeapi.ListContainersRequest) (*runtimeapi.ListContainersResponse, error) {
	s.r.record("ListContainers")
	return &runtimeapi.ListContainersResponse{Containers: s.r.filterContainers(req.GetFilter())}, nil
}

func (s *runtimeService) StreamContainers(req *runtimeapi.StreamContainersRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamContainersResponse]) error {
	s.r.record("StreamContainers")
	return sendChunks(s.r.filterContainers(req.GetFilter()), func(l []*runtimeapi.Container) error {
		return stream.Send(&runtimeapi.StreamContainersResponse{Containers: l})
	})
}

// filterContainers returns the containers that match f (ID, state, sandbox, labels), sorted by ID.
func (r *Runtime) filterContainers(f *runtimeapi.ContainerFilter) []*runtimeapi.Container {
	r.mu.RLock()
	defer r.mu.RUnlock()
	all := r.listContainersLocked()
	out := make([]*runtimeapi.Container, 0, len(all))
	for _, ct := range all {
		pb := ct.pb
		if f.GetId() != "" && pb.Id != f.Id ||
			f.GetState() != nil && pb.State != f.State.State ||
			f.GetPodSandboxId() != "" && pb.PodSandboxId != f.PodSandboxId ||
			!matchLabels(pb.Labels, f.GetLabelSelector()) {
			continue
		}
		out = append(out, pb)
	}
	return out
}

func (s *runtimeService) ContainerStatus(_ context.Context, req *runtimeapi.ContainerStatusRequest) (*runtimeapi.ContainerStatusResponse, error) {
	r := s.r
	r.record("ContainerStatus")
	r.mu.RLock()
	defer r.mu.RUnlock()
	ct, ok := r.containers[req.ContainerId]
	if !ok {
		return nil, containerNotFound(req.ContainerId)
	}
	pb := ct.pb
	return &runtimeapi.ContainerStatusResponse{Status: &runtimeapi.ContainerStatus{Id: pb.Id, Metadata: pb.Metadata,
		State: pb.State, CreatedAt: pb.CreatedAt, StartedAt: ct.startedAt, FinishedAt: ct.finishedAt, ExitCode: ct.exitCode,
		Image: pb.Image, ImageRef: pb.ImageRef, ImageId: pb.ImageId, Reason: ct.reason, Labels: pb.Labels,
		Annotations: pb.Annotations}}, nil
}

// UpdateRuntimeConfig accepts and ignores the config (there is no network to configure), as the kubelet
// sends one at start.
func (s *runtimeService) UpdateRuntimeConfig(context.Context, *runtimeapi.UpdateRuntimeConfigRequest) (*runtimeapi.UpdateRuntimeConfigResponse, error) {
	s.r.record("UpdateRuntimeConfig")
	return &runtimeapi.UpdateRuntimeConfigResponse{}, nil
}

func sandboxNotFound(id string) error {
	return status.Errorf(codes.NotFound, "an error occurred when try to find sandbox %q: not found", id)
}

func containerNotFound(id string) error {
	return status.Errorf(codes.NotFound, "an error occurred when try to find container %q: not found", id)
}
