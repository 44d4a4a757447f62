// Package tail finds the last lines of a file without reading it whole, with the semantics of the kubelet's
// pkg/util/tail (FindTailLineStartIndex from the older release, ReadAtMost from the current one).
package tail
