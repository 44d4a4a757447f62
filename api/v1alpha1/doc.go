// Package v1alpha1 holds imagefleet's Kubernetes API, group imagefleet.io, version v1alpha1: ImagePrePull
// and ImageGC, cluster-scoped objects that the controller (services/fleet/controller) turns into fleet
// rollouts on the bus and whose status it keeps (docs/kubernetes-objects.md).
//
// The CustomResourceDefinitions in the chart are generated from these types (go tool task crds).
//
// +kubebuilder:object:generate=true
// +groupName=imagefleet.io
package v1alpha1
