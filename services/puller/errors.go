package puller

import (
	"errors"
	"fmt"
	"strings"

	"github.com/distribution/reference"

	"github.com/imagefleet/imagefleet/events"
)

// Error kinds, the kubelet's (pkg/kubelet/images/types.go, k8s.io/cri-api/pkg/errors): the error's text is
// the container waiting reason. Compare with errors.Is.
var (
	ErrImagePullBackOff          = errors.New(events.ErrKindImagePullBackOff)
	ErrImageInspect              = errors.New(events.ErrKindImageInspect)
	ErrImagePull                 = errors.New(events.ErrKindImagePull)
	ErrImageNeverPull            = errors.New(events.ErrKindImageNeverPull)
	ErrInvalidImageName          = errors.New(events.ErrKindInvalidImageName)
	ErrRegistryUnavailable       = errors.New(events.ErrKindRegistryUnavailable)
	ErrSignatureValidationFailed = errors.New(events.ErrKindSignatureValidationFailed)
)

// Kubelet event reasons (pkg/kubelet/events/event.go).
const (
	ReasonPulling           = "Pulling"
	ReasonPulled            = "Pulled"
	ReasonFailed            = "Failed"
	ReasonInspectFailed     = "InspectFailed"
	ReasonErrImageNeverPull = "ErrImageNeverPull"
	ReasonBackOff           = "BackOff"
)

// errQPSExceeded is the throttled puller's refusal (the kubelet's throttledImageService).
var errQPSExceeded = errors.New("pull QPS exceeded")

// evalCRIPullErr classifies a pull error as the kubelet does: by the prefix of its text (gRPC errors do
// not support errors.Is). msg is the message of the container's waiting state.
func evalCRIPullErr(image string, err error) (msg string, kind error) {
	text := err.Error()
	if rest, ok := strings.CutPrefix(text, ErrRegistryUnavailable.Error()); ok {
		return fmt.Sprintf("image pull failed for %s because the registry is unavailable%s", image, rest), ErrRegistryUnavailable
	}
	if rest, ok := strings.CutPrefix(text, ErrSignatureValidationFailed.Error()); ok {
		return fmt.Sprintf("image pull failed for %s because the signature validation failed%s", image, rest), ErrSignatureValidationFailed
	}
	return text, ErrImagePull
}

// parseImageName is the kubelet's parsers.ParseImageName: the normalized repository, and the tag ("latest"
// when neither a tag nor a digest is given) or digest.
func parseImageName(image string) (repo, tag, digest string, err error) {
	named, err := reference.ParseNormalizedNamed(image)
	if err != nil {
		return "", "", "", fmt.Errorf("couldn't parse image name %q: %v", image, err)
	}
	repo = named.Name()
	if t, ok := named.(reference.Tagged); ok {
		tag = t.Tag()
	}
	if d, ok := named.(reference.Digested); ok {
		digest = d.Digest().String()
	}
	if tag == "" && digest == "" {
		tag = "latest"
	}
	return repo, tag, digest, nil
}

// applyDefaultImageTag appends ":latest" to an image with neither tag nor digest, textually: "busybox"
// becomes "busybox:latest", not "docker.io/library/busybox:latest" (the CRI stays agnostic of default
// hosts). Digest references are left alone.
func applyDefaultImageTag(image string) (string, error) {
	_, tag, digest, err := parseImageName(image)
	if err != nil {
		return "", err
	}
	if digest == "" && tag != "" && !strings.HasSuffix(image, ":"+tag) {
		image = image + ":" + tag
	}
	return image, nil
}

// defaultPullPolicy is Kubernetes' API defaulting of imagePullPolicy: Always for a :latest tag or an image
// with neither tag nor digest, else IfNotPresent.
func defaultPullPolicy(image string) string {
	named, err := reference.ParseNormalizedNamed(image)
	if err != nil {
		return events.PullAlways // the pull is refused as InvalidImageName before the policy matters
	}
	_, digested := named.(reference.Digested)
	t, tagged := named.(reference.Tagged)
	if digested && !tagged {
		return events.PullIfNotPresent
	}
	if !tagged || t.Tag() == "latest" {
		return events.PullAlways
	}
	return events.PullIfNotPresent
}

// kindOf returns the error kind name of err ("" for nil).
func kindOf(err error) string {
	for _, k := range []error{ErrImagePullBackOff, ErrImageInspect, ErrImagePull, ErrImageNeverPull,
		ErrInvalidImageName, ErrRegistryUnavailable, ErrSignatureValidationFailed} {
		if errors.Is(err, k) {
			return k.Error()
		}
	}
	if err != nil {
		return ErrImagePull.Error()
	}
	return ""
}
