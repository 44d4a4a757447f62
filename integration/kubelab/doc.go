// Package kubelab stands up a real Kubernetes control plane for integration tests and the operator's lab:
// etcd 3.7 and kube-apiserver v1.37.2 on free loopback ports with their own directory and PKI, static tokens
// for an admin and for node identities (Node,RBAC authorization and the NodeRestriction admission plugin, as
// in a cluster), and, when asked, kube-controller-manager and kube-scheduler v1.37.2 (Options.Controllers)
// and a kubelet v1.37.2 on a CRI runtime the caller started (integration/lab's private containerd, or
// deploy/lab's). AddLocalVolumes gives claims something to bind to: the lab has no provisioner.
//
// The binaries come from deploy/lab/kube/build.sh, which builds them from the module proxy into a cache
// directory keyed by the wrapper module's go.mod, go.sum and link flags (BinDir computes the same key). When they are
// missing the test helpers FAIL, naming the command that builds them; they never skip.
//
// Every fact the flags and clean-up steps rest on (and the failures they avoid) is in deploy/lab/README.md,
// "The kube lab".
package kubelab
