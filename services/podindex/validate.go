package podindex

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/distribution/reference"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/imagefleet/imagefleet/events"
)

// DecodePod decodes a core/v1 Pod given to `pods apply` (JSON): kind Pod (or none), apiVersion v1 (or
// none), a name; a pod without a namespace is in "default". Errors say what is wrong.
func DecodePod(data []byte) (*v1.Pod, error) {
	pod := &v1.Pod{}
	if err := events.UnmarshalPod(data, pod); err != nil {
		return nil, fmt.Errorf("not a core/v1 Pod: %w", err)
	}
	if pod.Kind != "" && pod.Kind != "Pod" {
		return nil, fmt.Errorf("a %q, not a Pod", truncateTo(pod.Kind, 64))
	}
	if pod.APIVersion != "" && pod.APIVersion != "v1" {
		return nil, fmt.Errorf("pod apiVersion %q is not v1", truncateTo(pod.APIVersion, 64))
	}
	if pod.Name == "" {
		return nil, fmt.Errorf("pod has no metadata.name")
	}
	if pod.Namespace == "" {
		pod.Namespace = "default"
	}
	return pod, nil
}

// ValidatePod checks a pod given to `pods apply` as the static source checks a manifest (validateStaticPod:
// the kubelet's ValidatePodCreate subset, with its texts), and, where imagefleet does better than the
// kubelet, refuses an image reference the puller could never pull: the kubelet accepts such a pod and
// fails each pull with InvalidImageName.
func ValidatePod(pod *v1.Pod) error {
	if len(pod.Spec.Containers) == 0 {
		return fmt.Errorf("invalid pod %s/%s: spec.containers: Required value", pod.Namespace, pod.Name)
	}
	errs := validateStaticPod(pod)
	spec := field.NewPath("spec")
	for _, list := range []struct {
		kind       string
		containers []v1.Container
	}{{"containers", pod.Spec.Containers}, {"initContainers", pod.Spec.InitContainers}} {
		for i, c := range list.containers {
			if c.Image == "" || len(c.Image) != len(strings.TrimSpace(c.Image)) {
				continue // said above
			}
			if _, err := reference.ParseNormalizedNamed(c.Image); err != nil {
				errs = append(errs, field.Invalid(spec.Child(list.kind).Index(i).Child("image"), c.Image,
					fmt.Sprintf("couldn't parse image name: %v", err)))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("invalid pod %s/%s: %s", pod.Namespace, pod.Name, truncate(errs.ToAggregate().Error()))
	}
	return nil
}

// validateStaticPod is the part of the kubelet's validation of a file-source pod (ValidatePodCreate, after
// the defaults of decodeManifest) that decides most manifests, in its order and with its field-error texts:
// the pod's name and namespace; each volume's type (exactly one source: only "none" is checked), name and
// uniqueness; each regular, then init container's name, image, pull policy and uniqueness (an init container's name is a duplicate
// when a regular container or an earlier init container has it); then images with leading or trailing
// whitespace. The rest of that validation (resources, probes, security contexts, ports, two sources in one
// volume ...) is the API server's code, which imagefleet does not carry: a manifest failing only those
// checks is indexed here where the kubelet would refuse it (docs/podindex.md).
func validateStaticPod(pod *v1.Pod) field.ErrorList {
	var errs field.ErrorList
	meta := field.NewPath("metadata")
	if pod.Name == "" {
		errs = append(errs, field.Required(meta.Child("name"), "name or generateName is required"))
	} else {
		for _, msg := range validation.IsDNS1123Subdomain(pod.Name) {
			errs = append(errs, field.Invalid(meta.Child("name"), pod.Name, msg))
		}
	}
	for _, msg := range validation.IsDNS1123Label(pod.Namespace) {
		errs = append(errs, field.Invalid(meta.Child("namespace"), pod.Namespace, msg))
	}
	spec := field.NewPath("spec")
	volumes := map[string]bool{}
	for i, vol := range pod.Spec.Volumes {
		path := spec.Child("volumes").Index(i)
		var el field.ErrorList
		if volumeSources(&vol.VolumeSource) == 0 {
			el = append(el, field.Required(path, "must specify a volume type"))
		}
		el = append(el, dnsLabel(vol.Name, path.Child("name"))...)
		if volumes[vol.Name] {
			el = append(el, field.Duplicate(path.Child("name"), vol.Name))
		}
		if len(el) == 0 {
			volumes[vol.Name] = true
		}
		errs = append(errs, el...)
	}
	names := map[string]bool{}
	for i, c := range pod.Spec.Containers {
		path := spec.Child("containers").Index(i)
		errs = append(errs, containerCommon(&c, path)...)
		if names[c.Name] {
			errs = append(errs, field.Duplicate(path.Child("name"), c.Name))
		} else {
			names[c.Name] = true
		}
	}
	for i, c := range pod.Spec.InitContainers {
		path := spec.Child("initContainers").Index(i)
		errs = append(errs, containerCommon(&c, path)...)
		if names[c.Name] {
			errs = append(errs, field.Duplicate(path.Child("name"), c.Name))
		} else if c.Name != "" {
			names[c.Name] = true
		}
	}
	for _, list := range []struct {
		kind       string
		containers []v1.Container
	}{{"containers", pod.Spec.Containers}, {"initContainers", pod.Spec.InitContainers}} {
		for i, c := range list.containers {
			if len(c.Image) != len(strings.TrimSpace(c.Image)) {
				errs = append(errs, field.Invalid(spec.Child(list.kind).Index(i).Child("image"), c.Image,
					"must not have leading or trailing whitespace"))
			}
		}
	}
	return errs
}

// containerCommon is the kubelet's check of a container's name and image (validateContainerCommon).
func containerCommon(c *v1.Container, path *field.Path) field.ErrorList {
	errs := dnsLabel(c.Name, path.Child("name"))
	if c.Image == "" {
		errs = append(errs, field.Required(path.Child("image"), ""))
	}
	return append(errs, pullPolicy(c.ImagePullPolicy, path.Child("imagePullPolicy"))...)
}

// pullPolicy is the kubelet's validatePullPolicy, less "Required": an empty policy is defaulted (Always for
// :latest or no tag, else IfNotPresent) where the kubelet validates after defaulting.
func pullPolicy(p v1.PullPolicy, path *field.Path) field.ErrorList {
	switch p {
	case "", v1.PullAlways, v1.PullIfNotPresent, v1.PullNever:
		return nil
	default:
		return field.ErrorList{field.NotSupported(path, p, []v1.PullPolicy{v1.PullAlways, v1.PullIfNotPresent, v1.PullNever})}
	}
}

// dnsLabel: Required when empty, else the RFC 1123 label errors.
func dnsLabel(name string, path *field.Path) field.ErrorList {
	if name == "" {
		return field.ErrorList{field.Required(path, "")}
	}
	var errs field.ErrorList
	for _, msg := range validation.IsDNS1123Label(name) {
		errs = append(errs, field.Invalid(path, name, msg))
	}
	return errs
}

// volumeSources counts the sources a volume names (the kubelet refuses none: "must specify a volume type").
func volumeSources(src *v1.VolumeSource) int {
	v := reflect.ValueOf(src).Elem()
	n := 0
	for i := range v.NumField() {
		if f := v.Field(i); f.Kind() == reflect.Pointer && !f.IsNil() {
			n++
		}
	}
	return n
}
