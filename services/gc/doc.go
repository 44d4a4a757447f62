// Package gc is the image GC executor of one node: the kubelet's image garbage collection policy (high and
// low thresholds, minimum and maximum age, eviction order, freeSpace, DeleteUnusedImages) with its events,
// messages and metric, driven over NATS and removing images through CRI. It reads image records from the
// detector (the single writer of records) and never writes them.
package gc
