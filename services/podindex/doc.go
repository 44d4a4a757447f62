// Package podindex is the pod index worker: the kubelet's pod manager (pods by UID and full name, mirror
// pods, the static/mirror UID translation, orphaned mirror pods) and its cache-based secret and configmap
// reference counting, driven by the pod events of one node, kept durable in JetStream, and a static-pod
// manifest source that publishes those events.
package podindex
