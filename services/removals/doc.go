// Package removals owns noticing another remover at work: an image that vanished from the node without an
// imagefleet removal (the kubelet's image GC or eviction manager, crictl rmi, another tool) is counted,
// logged, and reported as a Warning event on the node.
package removals
