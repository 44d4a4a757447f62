package cri

import (
	"context"
	"fmt"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// RunPodSandbox starts a host-network pod sandbox (no CNI is needed) and returns its ID.
func (c *Client) RunPodSandbox(ctx context.Context, sb SandboxConfig) (string, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: sandboxConfig(sb)})
	if err != nil {
		return "", mapErr(fmt.Sprintf("run pod sandbox %s/%s", sb.Namespace, sb.Name), err)
	}
	return r.PodSandboxId, nil
}

func sandboxConfig(sb SandboxConfig) *runtimeapi.PodSandboxConfig {
	return &runtimeapi.PodSandboxConfig{
		Metadata:    &runtimeapi.PodSandboxMetadata{Name: sb.Name, Namespace: sb.Namespace, Uid: sb.UID},
		Annotations: sb.Annotations,
		Linux: &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
			NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE},
		}},
	}
}

// CreateContainer creates a container from image in a sandbox and returns its ID.
func (c *Client) CreateContainer(ctx context.Context, sandboxID string, sb SandboxConfig, name, image string, command []string) (string, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{
		PodSandboxId:  sandboxID,
		SandboxConfig: sandboxConfig(sb),
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: name},
			Image:    &runtimeapi.ImageSpec{Image: image},
			Command:  command,
			Linux:    &runtimeapi.LinuxContainerConfig{},
		},
	})
	if err != nil {
		return "", mapErr(fmt.Sprintf("create container %s", name), err)
	}
	return r.ContainerId, nil
}

// StartContainer starts a created container.
func (c *Client) StartContainer(ctx context.Context, id string) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	_, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id})
	return mapErr(fmt.Sprintf("start container %s", id), err)
}

// StopPodSandbox stops a sandbox and its containers.
func (c *Client) StopPodSandbox(ctx context.Context, id string) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	_, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id})
	return mapErr(fmt.Sprintf("stop pod sandbox %s", id), err)
}

// RemovePodSandbox removes a stopped sandbox and its containers.
func (c *Client) RemovePodSandbox(ctx context.Context, id string) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	_, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id})
	return mapErr(fmt.Sprintf("remove pod sandbox %s", id), err)
}
