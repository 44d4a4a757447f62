package lab

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/services/cri"
)

// PodNamespace is the namespace of the pods RunPod starts.
const PodNamespace = "lab"

// PodSandboxConfig is the sandbox config RunPod uses for name: namespace PodNamespace, UID "uid-"+name.
func PodSandboxConfig(name string) cri.SandboxConfig {
	return cri.SandboxConfig{Name: name, Namespace: PodNamespace, UID: "uid-" + name}
}

// RunPod starts a host-network pod sandbox named name (see PodSandboxConfig) with one container, also named
// name, from image (its own command: the busybox image of PushBusybox sleeps forever), and returns their
// IDs once the container has started. The pod is stopped and removed when the test ends, if containerd
// still runs then (Containerd's own cleanup removes what is left otherwise).
func RunPod(t testing.TB, c *Containerd, name, image string) (sandboxID, containerID string) {
	t.Helper()
	ctx := t.Context()
	cl := c.Client()
	sb := PodSandboxConfig(name)
	sandboxID, err := cl.RunPodSandbox(ctx, sb)
	if err != nil {
		t.Fatalf("lab: run pod %s: %v", name, err)
	}
	t.Cleanup(func() {
		if !c.Running() {
			return
		}
		// t.Context is already done when cleanups run.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cl.StopPodSandbox(ctx, sandboxID); err != nil && !errors.Is(err, cri.ErrNotFound) {
			t.Errorf("lab: cleanup pod %s: %v", name, err)
			return
		}
		if err := cl.RemovePodSandbox(ctx, sandboxID); err != nil && !errors.Is(err, cri.ErrNotFound) {
			t.Errorf("lab: cleanup pod %s: %v", name, err)
		}
	})
	containerID, err = cl.CreateContainer(ctx, sandboxID, sb, name, image, nil)
	if err != nil {
		t.Fatalf("lab: run pod %s: %v", name, err)
	}
	if err := cl.StartContainer(ctx, containerID); err != nil {
		t.Fatalf("lab: run pod %s: %v", name, err)
	}
	return sandboxID, containerID
}
