package cri

import "testing"

func TestSandboxImageFromInfo(t *testing.T) {
	for _, tc := range []struct {
		name string
		info map[string]string
		want string
	}{
		// containerd 1.6's verbose Status, trimmed (keys as the lab's containerd 1.6 reports them).
		{"containerd", map[string]string{
			"config":            `{"containerd":{"snapshotter":"overlayfs","defaultRuntimeName":"runc"},"sandboxImage":"registry.k8s.io/pause:3.6","maxConcurrentDownloads":3}`,
			"lastCNILoadStatus": "cni config load failed",
			"golang":            `"go1.19.8"`,
		}, "registry.k8s.io/pause:3.6"},
		{"cri-o", map[string]string{"config": `{"crio":{"image":{"pause_image":"registry.k8s.io/pause:3.10"}}}`}, "registry.k8s.io/pause:3.10"},
		{"nothing said", map[string]string{"config": `{"containerd":{}}`, "golang": "not json"}, ""},
		{"no info", nil, ""},
	} {
		if got := SandboxImageFromInfo(tc.info); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
