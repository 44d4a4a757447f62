// Package cache keeps the node's image list for node status and queries: refreshed every 30 s from CRI and
// sorted by size descending, ties by ID descending, as the kubelet's image cache.
package cache
