package cri

import (
	"fmt"
	"syscall"
)

// Statfs returns the capacity and available bytes of the filesystem holding path (what cAdvisor gives the
// kubelet for the image filesystem; CRI's ImageFsInfo reports only used bytes).
func Statfs(path string) (capacity, available int64, err error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize, nil
}
