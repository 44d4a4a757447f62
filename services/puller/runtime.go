package puller

import (
	"context"
	"errors"
	"log/slog"

	corev1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/services/cri"
)

// runtime is the part of the CRI client the puller needs.
type runtime interface {
	ImageStatus(ctx context.Context, ref string) (cri.Image, error)
	PullImage(ctx context.Context, ref string, auth *cri.AuthConfig, sandbox *cri.SandboxConfig, annotations map[string]string) (string, error)
}

// criImages is the kubelet's kuberuntime image service over CRI.
type criImages struct{ rt runtime }

func (c criImages) GetImageRef(ctx context.Context, image string) (string, error) {
	im, err := c.rt.ImageStatus(ctx, image)
	if errors.Is(err, cri.ErrNotFound) {
		return "", nil
	}
	if err != nil {
		return "", errors.New(cri.RuntimeMessage(err))
	}
	return im.ID, nil
}

// PullImage returns the runtime's own message on failure (the gRPC status message), which is what the
// kubelet classifies by prefix (RegistryUnavailable, SignatureValidationFailed) and shows.
func (c criImages) PullImage(ctx context.Context, image string, auth *cri.AuthConfig, sb *cri.SandboxConfig, ann map[string]string) (string, error) {
	ref, err := c.rt.PullImage(ctx, image, auth, sb, ann)
	if err != nil {
		return "", errors.New(cri.RuntimeMessage(err))
	}
	return ref, nil
}

func (c criImages) GetImageSize(ctx context.Context, image string) (uint64, error) {
	im, err := c.rt.ImageStatus(ctx, image)
	if err != nil {
		return 0, err
	}
	return uint64(max(im.Size, 0)), nil
}

// fileCredentials resolves a request's credentials from the pull secrets directory and the node keyring.
type fileCredentials struct {
	secrets *secretsDir
	node    *keyring
	log     *slog.Logger
}

// Lookup is the kubelet's MakeDockerKeyring(pullSecrets, nodeKeyring).Lookup(repo): the pod's secrets'
// matches first, then the node's. A secret the node does not have is skipped with a warning, as the
// kubelet does with a pull secret it cannot fetch.
func (f *fileCredentials) Lookup(_ context.Context, repo string, req Request) ([]Credential, error) {
	var out []Credential
	if len(req.Secrets) > 0 && f.secrets != nil {
		var found []corev1.Secret
		for _, name := range req.Secrets {
			s, ok, err := f.secrets.get(req.Pod.Namespace, name)
			if err != nil {
				return nil, err
			}
			if !ok {
				f.log.Warn("unable to retrieve pull secret, the image pull may not succeed", "pod_uid", req.Pod.UID,
					"secret", req.Pod.Namespace+"/"+name)
				continue
			}
			found = append(found, s)
		}
		k, err := secretKeyring(found)
		if err != nil {
			return nil, err
		}
		out = append(out, k.lookup(repo)...)
	}
	out = append(out, f.node.lookup(repo)...)
	return out, nil
}
