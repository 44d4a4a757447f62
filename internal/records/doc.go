// Package records is the kubelet's image detection (detectImages) as a pure function over CRI listings:
// the detector worker, the single writer of records, runs it; the GC executor's test kit runs the same
// function in memory, so its kubelet tests hold the detector's exact semantics without importing a worker.
package records
