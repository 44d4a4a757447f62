// Package puller owns EnsureImageExists for a node: the kubelet's pull policies, image name validation,
// per pod-and-image backoff, registry credentials and KEP-2535 pull records, and serial or token-limited
// parallel pulls fed by a JetStream work queue whose per-node limits the NATS server enforces.
package puller
