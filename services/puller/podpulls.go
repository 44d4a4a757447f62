package puller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/imagefleet/imagefleet/events"
)

// mirrorPodAnnotation marks a mirror pod (the API server's copy of a static pod): its containers are the
// static pod's, run and pulled for under the static pod.
const mirrorPodAnnotation = "kubernetes.io/config.mirror"

// PodPullRequests are the pull requests a newly added pod stands for: one per container (init, regular,
// ephemeral) in spec order, with the container's pull policy, the pod's pull secrets and annotations, as the
// kubelet's EnsureImageExists would be called when each container starts. A container naming the same image
// as an earlier one adds nothing. A mirror pod, a pod without a UID and a pod in a terminal phase stand for
// none.
//
// A request's ID is derived from the pod UID, the container and the image, so the same pod event seen by
// two puller replicas, or delivered twice, enqueues each pull once (Nats-Msg-Id de-duplication).
func PodPullRequests(pod *v1.Pod, now time.Time) []events.PullRequest {
	if pod.UID == "" || pod.Annotations[mirrorPodAnnotation] != "" ||
		pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		return nil
	}
	var secrets []string
	for _, s := range pod.Spec.ImagePullSecrets {
		if s.Name != "" {
			secrets = append(secrets, s.Name)
		}
	}
	seen := map[string]bool{}
	var out []events.PullRequest
	add := func(field, name, image string, policy v1.PullPolicy) {
		if image == "" || seen[image] {
			return
		}
		seen[image] = true
		sum := sha256.Sum256([]byte(string(pod.UID) + "\x00" + name + "\x00" + image))
		// The kubelet's container reference (kubecontainer.GenerateContainerRef): its pull events are
		// about the container's field in the pod.
		ref := &events.PodRef{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID),
			FieldPath: field + "{" + name + "}"}
		out = append(out, events.PullRequest{ID: "pod-" + hex.EncodeToString(sum[:16]), Image: image,
			Policy: string(policy), Pod: ref, Secrets: secrets, Annotations: pod.Annotations, Enqueued: now})
	}
	for _, c := range pod.Spec.InitContainers {
		add("spec.initContainers", c.Name, c.Image, c.ImagePullPolicy)
	}
	for _, c := range pod.Spec.Containers {
		add("spec.containers", c.Name, c.Image, c.ImagePullPolicy)
	}
	for _, c := range pod.Spec.EphemeralContainers {
		add("spec.ephemeralContainers", c.Name, c.Image, c.ImagePullPolicy)
	}
	return out
}

// handlePodAdded enqueues the pulls a pod.added event stands for (Config.PullOnPodAdd). A full queue is
// logged and counted, not retried: the pod's next pull request (or the runtime at container start) does
// it, and a flood of pod events must not turn into a flood of retries.
func (s *Service) handlePodAdded(ctx context.Context, subject string, header map[string][]string, data []byte) {
	ev, err := events.DecodePodEvent(subject, header, data)
	if err != nil {
		s.m.cfg.log.Warn("pod added event refused; no pulls enqueued", "err", err)
		return
	}
	pod := ev.Pod
	for _, req := range PodPullRequests(pod, s.m.cfg.now()) {
		_, err := Enqueue(ctx, s.bus, s.cfg.Node, req)
		switch {
		case err == nil:
			s.m.cfg.log.Debug("pull enqueued for an added pod", "pod", pod.Namespace+"/"+pod.Name, "image", req.Image, "request", req.ID)
		case errors.Is(err, ErrPullQueueFull):
			s.m.cfg.log.Warn("pull queue full; pull for an added pod not enqueued", "pod", pod.Namespace+"/"+pod.Name, "image", req.Image)
		default:
			s.m.cfg.log.Warn("enqueue pull for an added pod", "pod", pod.Namespace+"/"+pod.Name, "image", req.Image,
				"err", fmt.Sprintf("%v", err))
		}
	}
}
