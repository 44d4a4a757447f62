package bustest

import "syscall"

// childAttr has a cluster's server process killed when the test binary dies.
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
