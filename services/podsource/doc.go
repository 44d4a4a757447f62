// Package podsource turns the pods of a Kubernetes node, read from the kubelet's Pods API or from the API
// server, into the pod index's pod.added / pod.updated / pod.deleted events, publishing only what the index
// does not already hold, so a resync (after a disconnect, a watch expiry or an agent restart) loses no
// deletion and replays no duplicate.
package podsource
