package socket

// Candidate is a place where a runtime puts its CRI socket.
type Candidate struct {
	// Runtime names who listens there ("k3s, RKE2"), for the log and the error.
	Runtime string
	// Path is the socket's path on the host.
	Path string
}

// Candidates returns the known places of the CRI socket in the order Discover tries them.
//
// A distribution's own path comes before the generic containerd path: that path exists only where the
// distribution runs, and then its kubelet uses it, while a node beside k3s, RKE2 or MicroK8s may run a
// second containerd at the generic path that no kubelet uses (Docker's, or a leftover install). CRI-O and
// containerd on one node is rare enough to let the order decide. cri-dockerd comes last because a Docker
// host also runs containerd at the generic path: that one usually answers that it does not serve CRI (Docker
// disables the plugin) and is then passed over, but where it does serve CRI it has none of Docker's images.
//
// Talos has no entry of its own: its kubelet's containerd listens at the generic path, and
// /system/run/containerd/containerd.sock is Talos's system containerd, which holds no pod images and must
// not be used.
//
// The /var/run forms are the same files on every current distribution (/var/run links to /run); they are
// tried for hosts where it does not, and for pods that mount the host's /var/run rather than /run. Discover
// probes a socket it has already seen under another name only once.
func Candidates() []Candidate {
	return []Candidate{
		{Runtime: "k3s, RKE2", Path: "/run/k3s/containerd/containerd.sock"},
		{Runtime: "k0s", Path: "/run/k0s/containerd.sock"},
		{Runtime: "k0s (older releases)", Path: "/var/lib/k0s/run/containerd.sock"},
		{Runtime: "MicroK8s", Path: "/var/snap/microk8s/common/run/containerd.sock"},
		{Runtime: "containerd", Path: "/run/containerd/containerd.sock"},
		{Runtime: "containerd", Path: "/var/run/containerd/containerd.sock"},
		{Runtime: "CRI-O", Path: "/run/crio/crio.sock"},
		{Runtime: "CRI-O", Path: "/var/run/crio/crio.sock"},
		{Runtime: "cri-dockerd", Path: "/run/cri-dockerd.sock"},
		{Runtime: "cri-dockerd", Path: "/var/run/cri-dockerd.sock"},
	}
}
