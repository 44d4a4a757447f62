package cri

import "time"

// Image is one image the runtime lists.
type Image struct {
	ID          string
	RepoTags    []string
	RepoDigests []string
	Size        int64
	Pinned      bool
}

// ContainerState mirrors the CRI container states.
type ContainerState int

// Container states.
const (
	ContainerCreated ContainerState = iota
	ContainerRunning
	ContainerExited
	ContainerUnknown
)

// Container is one container the runtime lists (running or exited).
type Container struct {
	ID           string
	PodSandboxID string
	Name         string
	// Image is the image spec the container was created from (a reference or an ID).
	Image string
	// ImageID is the CRI image_id: the ID of the image, the kubelet's in-use key (ImageRef for old runtimes).
	ImageID string
	State   ContainerState
	Labels  map[string]string
}

// FsInfo is the runtime's image filesystem.
type FsInfo struct {
	Mountpoint string
	UsedBytes  uint64
	Timestamp  time.Time
}

// AuthConfig is a registry credential sent with a pull. Never logged.
type AuthConfig struct {
	Username      string
	Password      string
	Auth          string
	ServerAddress string
	IdentityToken string
	RegistryToken string
}

// String hides the secrets, so a credential that reaches a log by accident shows nothing.
func (a AuthConfig) String() string { return "AuthConfig{server=" + a.ServerAddress + ", <redacted>}" }

// GoString hides the secrets from %#v too.
func (a AuthConfig) GoString() string { return a.String() }

// SandboxConfig is the part of a pod sandbox config imagefleet sends with a pull or a sandbox start.
type SandboxConfig struct {
	Name, Namespace, UID string
	Annotations          map[string]string
}
