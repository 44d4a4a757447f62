// Package lab stands up real parts for integration tests: a private, sandboxed containerd whose image
// filesystem is a small tmpfs (so disk usage crosses GC thresholds for real), an OCI registry on loopback
// (go-containerregistry's handler, with optional basic auth and request accounting), test images of a chosen
// size pushed to it, and host-network pods run through CRI.
//
// Nothing here is a double: containerd, runc and the registry protocol are the real ones. The runtime tier
// needs root and the Debian packages containerd, runc and busybox-static; when they are missing the helpers
// fail the test (they never skip), naming the missing part and the .ci/run step that installs it.
//
// Why each containerd setting is there is written in deploy/lab/README.md ("Why the containerd settings");
// the operator's lab in deploy/lab uses the same settings from a shell template.
package lab
