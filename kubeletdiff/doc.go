// Package kubeletdiff compares imagefleet with the kubelet's own code (k8s.io/kubernetes v1.37.2) on seeded
// random cases: image GC, the pod manager, the secret and configmap visitors and the cache-based manager's
// reference counts. It is a separate module so that the main module never depends on k8s.io/kubernetes.
package kubeletdiff
