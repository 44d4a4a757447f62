package cri

import (
	"context"
	"encoding/json"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// SandboxImage returns the runtime's own pod sandbox (pause) image, from its verbose Status: containerd puts
// its CRI plugin configuration as JSON under the "config" key, with "sandboxImage" (verified on containerd
// 1.6: {"containerd":{...},...,"sandboxImage":"registry.k8s.io/pause:3.6",...}); CRI-O's configuration names
// it "pause_image". Every info value is searched for either key, at any depth. "" when the runtime does not
// say.
func (c *Client) SandboxImage(ctx context.Context) (string, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.rt.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return "", mapErr("runtime status", err)
	}
	return SandboxImageFromInfo(r.Info), nil
}

// SandboxImageFromInfo finds the sandbox image in a verbose Status's info (see Client.SandboxImage).
func SandboxImageFromInfo(info map[string]string) string {
	for _, key := range []string{"config", "info"} {
		if img := findSandboxImage(info[key]); img != "" {
			return img
		}
	}
	for _, v := range info {
		if img := findSandboxImage(v); img != "" {
			return img
		}
	}
	return ""
}

func findSandboxImage(raw string) string {
	var v any
	if json.Unmarshal([]byte(raw), &v) != nil {
		return ""
	}
	return walkSandboxImage(v, 0)
}

func walkSandboxImage(v any, depth int) string {
	if depth > 8 {
		return ""
	}
	m, ok := v.(map[string]any)
	if !ok {
		return ""
	}
	for _, key := range []string{"sandboxImage", "pause_image", "pauseImage"} {
		if s, ok := m[key].(string); ok && s != "" {
			return s
		}
	}
	for _, child := range m {
		if s := walkSandboxImage(child, depth+1); s != "" {
			return s
		}
	}
	return ""
}
