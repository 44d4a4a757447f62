// Package detector keeps each node's image records (first detected, last used, size, pinned, in use) from CRI,
// with the kubelet's detectImages semantics, in JetStream KV so they survive restarts.
package detector
